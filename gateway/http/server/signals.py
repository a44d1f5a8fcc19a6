"""Signals no gateway process dies of unannounced: SIGHUP, SIGUSR1 and SIGUSR2.

Their default action ends the process (exit 129, 138, 140) without a line in the log. A
process manager or an operator sends them expecting something else: SIGHUP means
"reload" (``docs/operations.md``, "Signals"), SIGUSR1 is what log rotators send to make
a daemon reopen its log files (the gateway writes to stderr only: nothing to reopen).

* ``announce_signals``: from the start of a process to its end, each of the three is
  logged and ignored; the CLI calls it first thing, and each process ``serve --workers N``
  forks calls it again (a fork inherits the supervisor's own handlers).
* ``on_hangup``: while a part that can reload is up (the app's lifespan), SIGHUP calls it
  instead, on the event loop; afterwards the ignoring handler is back, so SIGHUP during
  start-up or shutdown is announced too.

SIGTERM and SIGINT are uvicorn's (``uvicorn_private.DrainingServer``); SIGPIPE is ignored
by Python itself (a closed connection is an error on that connection only); SIGQUIT keeps
its default, by choice (``docs/operations.md``, "Signals").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["announce_signals", "on_hangup"]

log = logging.getLogger("gateway.signals")

_WHY = {
    signal.SIGHUP: "the gateway is not up (starting or stopping): nothing to reload now",
    signal.SIGUSR1: "the gateway gives SIGUSR1 no meaning (it logs to stderr only: no log "
    "file to reopen)",
    signal.SIGUSR2: "the gateway gives SIGUSR2 no meaning",
}


def _ignored(signum: int, _frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    log.warning("%s ignored: %s", name, _WHY[signal.Signals(signum)], extra={"event": "signal"})


def announce_signals() -> None:
    """SIGHUP, SIGUSR1 and SIGUSR2 are logged and ignored from now on (SIGHUP until
    ``on_hangup`` takes it). Only the main thread can set handlers: elsewhere, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _WHY:
        signal.signal(sig, _ignored)


@contextlib.contextmanager
def on_hangup(callback: Callable[[], None]) -> Iterator[None]:
    """While inside: SIGHUP calls ``callback`` on the running loop (a loop callback, not a
    signal handler: it may start tasks). On exit, the handler found on entry is back. An
    app served off the main thread (a test's) cannot take signals: nothing changes."""
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGHUP)
    try:
        loop.add_signal_handler(signal.SIGHUP, callback)
    except (ValueError, RuntimeError, NotImplementedError):
        taken = False
    else:
        taken = True
    try:
        yield
    finally:
        if taken:
            loop.remove_signal_handler(signal.SIGHUP)  # leaves SIG_DFL: put back the one found
            signal.signal(signal.SIGHUP, signal.SIG_DFL if previous is None else previous)
