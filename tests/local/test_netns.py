"""The chaos run's network cuts (``rollout_testbed.local.netns``), each mode against a real
HTTP server in a real namespace: what the gateway will meet when the chaos run cuts a
replica's network, checked here so a chaos result can be trusted to have cut it.

Needs root, iproute2 and iptables, as the TRL layer does; without them this fails and
says why (a skipped test would count a cut never made as a cut that works).
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rollout_testbed.local import netns

from tests.eventually import STALL_S

# Sends no byte in this long: a dropped packet is never answered, so this bound only
# decides how long the test waits, never whether it passes.
SILENT_S = 1.0
# An answer that must come comes within this: it outlasts a stalled machine (STALL_S) many
# times, and only a failing test ever waits it out.
ANSWER_S = 4 * STALL_S
SERVER = """
import http.server, socketserver, sys
marks = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the answers_lost test needs an open connection
    def do_GET(self):
        open(marks, "a").write(self.path + "\\n")
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a): pass
class S(http.server.HTTPServer):
    def server_bind(self):  # no getfqdn: the namespace has no DNS (a 10 s wait)
        socketserver.TCPServer.server_bind(self)
S((sys.argv[1], 18080), H).serve_forever()
"""


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait for a marker (bounded); the bound only decides how long a failure takes."""
    deadline = time.monotonic() + timeout
    while not _quiet(check):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def _quiet(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except OSError:
        return False


def _get(ns: netns.Netns, path: str, timeout: float = ANSWER_S) -> int:
    conn = http.client.HTTPConnection(ns.ns_ip, 18080, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[netns.Netns, Path]]:
    why_not = netns.available()
    assert why_not is None, why_not
    ns = netns.create(0, tag=f"{os.getpid()}t")
    marks = tmp_path / "marks"
    marks.touch()
    proc = subprocess.Popen([*ns.prefix(), sys.executable, "-c", SERVER, ns.ns_ip, str(marks)])
    try:
        eventually(lambda: _get(ns, "/up") == 200, timeout=20, what="server in the namespace")
        yield ns, marks
    finally:
        proc.kill()
        proc.wait(10)
        ns.delete()


@pytest.mark.parametrize("mode", ["partition", "requests_lost"])
def test_drops_leave_the_client_without_an_answer(
    served: tuple[netns.Netns, Path], mode: str
) -> None:
    ns, marks = served
    ns.cut(18080, mode)
    with pytest.raises((TimeoutError, socket.timeout)):
        _get(ns, f"/{mode}", timeout=SILENT_S)
    assert f"/{mode}" not in marks.read_text()  # nothing reached the replica
    ns.mend()
    assert _get(ns, "/mended") == 200


def test_reject_refuses_at_once(served: tuple[netns.Netns, Path]) -> None:
    ns, _ = served
    ns.cut(18080, "reject")
    # A reset or a refusal is a ConnectionError; a dropped packet would end in TimeoutError
    # (not a ConnectionError) after ANSWER_S: the exception's type is the proof, not a clock.
    with pytest.raises(ConnectionError):
        _get(ns, "/rejected")
    ns.mend()
    assert _get(ns, "/mended") == 200


def test_answers_lost_reach_the_replica_but_never_come_back(
    served: tuple[netns.Netns, Path],
) -> None:
    """On an open connection (the gateway keeps them) the replica gets the request and
    acts on it; its answer is lost. A new connection never completes its handshake."""
    ns, marks = served
    conn = http.client.HTTPConnection(ns.ns_ip, 18080, timeout=ANSWER_S)
    try:
        conn.request("GET", "/before")
        assert conn.getresponse().read() == b"ok"
        assert conn.sock is not None
        conn.sock.settimeout(SILENT_S)  # from here on no answer is awaited
        ns.cut(18080, "answers_lost")
        conn.request("GET", "/acted-on")
        with pytest.raises((TimeoutError, socket.timeout)):
            conn.getresponse()
    finally:
        conn.close()
    eventually(lambda: "/acted-on" in marks.read_text(), timeout=10, what="the request acted on")
    with pytest.raises((TimeoutError, socket.timeout)):
        _get(ns, "/new-connection", timeout=SILENT_S)
    assert "/new-connection" not in marks.read_text()
    ns.mend()
    assert _get(ns, "/mended") == 200


def test_mend_leaves_no_rule_and_delete_leaves_no_namespace(
    served: tuple[netns.Netns, Path],
) -> None:
    ns, _ = served
    for mode in netns.MODES:
        ns.cut(18080, mode)
    assert "DROP" in ns.rules() and "REJECT" in ns.rules()
    ns.mend()
    assert "DROP" not in ns.rules() and "REJECT" not in ns.rules()
    with pytest.raises(ValueError):
        ns.cut(18080, "sideways")


def test_sweep_removes_only_namespaces_of_dead_creators() -> None:
    live = netns.create(7)  # this process's PID: alive
    dead = netns.create(2, tag="999999999")  # no such PID
    try:
        gone = netns.sweep_stale()
        assert dead.name in gone and live.name not in gone
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert live.name in names and dead.name not in names
    finally:
        live.delete()
        dead.delete()
