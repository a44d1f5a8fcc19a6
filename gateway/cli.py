"""``rollout-gateway``: one entry point, one subcommand per job (``main`` lists them).

Every ``serve`` flag also reads ``GATEWAY_<NAME>`` from the environment and ``<name>`` from
the YAML ``--config`` file (flags win, then env, then file). Secrets also come from files.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, get_args

from pydantic import ValidationError

if TYPE_CHECKING:
    from gateway.config import Settings

__all__ = ["main"]

# Subcommands that live in the rollout-testbed distribution since the sidecar stopped
# shipping them: name -> what to run instead.
_MOVED = {
    "sim-replica": "rollout-testbed sim-replica",
    "make-tiny-model": "rollout-testbed make-tiny-model",
    "replicas": "rollout-testbed replicas",
    "train": "python -m trainer",
}

_SERVE_EPILOG = """\
environment: every flag has a GATEWAY_* variable, e.g. GATEWAY_REPLICAS (comma-separated
or a JSON list), GATEWAY_PORT, GATEWAY_UPSTREAM_TOKEN, GATEWAY_API_KEY, GATEWAY_ADMIN_KEY,
GATEWAY_MAX_STALENESS, GATEWAY_ADAPTER_ROOTS (os.pathsep-separated), GATEWAY_CONFIG,
GATEWAY_LOG_FORMAT. Secrets can be read from files: --upstream-token-file /
GATEWAY_UPSTREAM_TOKEN_FILE, and likewise for the API and admin keys. Precedence: flags,
then environment, then the --config YAML file, then defaults; for a secret, the highest
layer giving it as a value or as a file wins. An unknown GATEWAY_* variable or YAML key
is an error. Settings without a flag, and why: docs/configuration.md.
"""

# Settings with no flag, and why (docs/configuration.md repeats it; tests/test_cli_checks.py
# holds every setting to a flag or an entry here).
NO_FLAG = {
    "runs": "structured (a list of runs with keys): YAML, or JSON in GATEWAY_RUNS",
    "routing": "structured (RoutingConfig fields): YAML, or JSON in GATEWAY_ROUTING",
    "lora_slots_per_replica": "many-runs placement: lives in the YAML beside runs",
    "run_pause": "many-runs pause semantics: lives in the YAML beside runs",
    "replica_capacity": "many-runs fair share: lives in the YAML beside runs",
    "fair_wait_s": "many-runs fair share: lives in the YAML beside runs",
    "fair_idle_s": "many-runs fair share: lives in the YAML beside runs",
    "adapter_name_pattern": "a regex agreed with the trainer's names, set once",
    "adapter_retry_initial_s": "mount-lag backoff detail; --adapter-load-deadline-s bounds it",
    "adapter_retry_max_s": "mount-lag backoff detail; --adapter-load-deadline-s bounds it",
    "adapter_unload_grace_s": "in-flight grace of an unload, not an incident lever",
    "adapter_audit_interval_s": "drift check period of healthy replicas, cheap at 30 s",
    "max_header_bytes": "request-shape limit, set once per deployment",
    "max_header_count": "request-shape limit, set once per deployment",
    "max_json_depth": "request-shape limit, set once per deployment",
    "max_n": "request-shape limit, set once per deployment",
    "max_connections": "connection-pool size, sized from measurements (docs/performance.md)",
    "outlier_max_ejection_s": "breaker tuning, measured (docs/reliability.md)",
    "outlier_max_ejected_fraction": "breaker tuning, measured (docs/reliability.md)",
    "retry_budget_ratio": "retry-budget tuning, measured (docs/reliability.md)",
    "retry_budget_min_per_s": "retry-budget tuning, measured (docs/reliability.md)",
}


class _OneLineParser(argparse.ArgumentParser):
    """A flag mistake is a start error like any other: one line and exit 2, not argparse's
    usage block (``--help`` prints that)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def _serve_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="rollout-gateway serve",
        description="Serve N vLLM replicas as one TRL-compatible vLLM endpoint.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    add = p.add_argument
    add(
        "--replica",
        dest="replicas",
        action="append",
        metavar="URL",
        help="upstream vLLM base URL, e.g. http://127.0.0.1:8101 (repeat per replica)",
    )
    add(
        "--discovery-dns",
        metavar="NAME:PORT",
        help="discover replicas from a DNS name's A/AAAA records (e.g. a headless Service)",
    )
    add(
        "--discovery-nameserver",
        metavar="HOST:PORT",
        help="query this DNS server instead of the system resolver",
    )
    add(
        "--replicas-file",
        metavar="FILE",
        help="discover replicas from FILE (YAML list or one URL per line); reloaded on "
        "change or SIGHUP",
    )
    add(
        "--discovery-interval-s",
        type=float,
        help="re-resolve / re-check period for discovery (default 5)",
    )
    add("--host", help="address to listen on (default 127.0.0.1)")
    add("--port", type=int, help="port to listen on (default 8000)")
    add(
        "--upstream-token",
        metavar="TOKEN",
        help="sent upstream as 'Authorization: Bearer TOKEN'; prefer --upstream-token-file",
    )
    add("--upstream-token-file", metavar="FILE", help="read the upstream token from FILE")
    add("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' from clients")
    add("--api-key-file", metavar="FILE", help="read the client API key from FILE")
    add(
        "--admin-key",
        metavar="KEY",
        help="additionally require this key for load/unload/pause/resume/reset",
    )
    add("--admin-key-file", metavar="FILE", help="read the admin key from FILE")
    add(
        "--no-auth",
        action="store_true",
        help="serve clients without a key on a non-loopback --host: the explicit choice of "
        "no auth (without a key or this, such a start is refused)",
    )
    add(
        "--max-staleness",
        type=int,
        metavar="S",
        help="keep the newest S+1 versions of each adapter family (default 4)",
    )
    add(
        "--adapter-root",
        dest="adapter_roots",
        action="append",
        metavar="DIR",
        help="lora_path must resolve inside DIR (repeatable)",
    )
    add("--router", choices=_choices("router"), help="routing policy (default prefix)")
    add("--config", metavar="FILE", help="YAML file with any of these settings")
    add("--log-format", choices=["text", "json"], help="log line format (default text)")
    add("--log-level", help="logging level (default INFO)")
    add(
        "--request-id-header",
        dest="request_id_headers",
        action="append",
        metavar="NAME",
        help="read the client's request id from header NAME, first present wins "
        "(repeatable; default x-request-id)",
    )
    add("--health-interval-s", type=float, help="active health probe period (default 2)")
    add("--health-timeout-s", type=float, help="timeout of one health probe (default 2)")
    add("--unhealthy-threshold", type=int, help="failed probes before ejection (default 2)")
    add("--healthy-threshold", type=int, help="good probes before re-admission (default 1)")
    add(
        "--health-min-replicas",
        type=int,
        metavar="N",
        help="degraded mode: /health is 200 with at least N replicas up, and control calls "
        "need N (default: all for /health, 1 for control calls)",
    )
    add("--connect-timeout-s", type=float, help="TCP connect timeout to a replica (default 5)")
    add(
        "--read-timeout-s",
        type=float,
        help="longest silence while reading a replica's answer (default 600)",
    )
    add(
        "--broadcast-timeout-s",
        type=float,
        help="per-replica timeout of pause/resume/load/unload; a replica that misses it is "
        "lost, not failed (default 120)",
    )
    add(
        "--adapter-load-deadline-s",
        type=float,
        help="retry 'No adapter found' (shared-filesystem lag) this long, then 504 (default 300)",
    )
    add("--upstream-ca-file", metavar="FILE", help="PEM CA bundle for https:// replicas")
    add("--max-tokens-limit", type=int, help="largest max_tokens accepted (default: none)")
    add("--max-body-bytes", type=int, help="request body limit (default 32 MiB)")
    add("--max-in-flight", type=int, help="proxied requests in flight before 429 (default 4096)")
    add("--max-in-flight-per-client", type=int, help="same, per client credential (default off)")
    add(
        "--outlier-consecutive-errors",
        type=int,
        help="5xx/429 answers in a row that eject a replica; 0 disables (default 5)",
    )
    add("--outlier-ejection-s", type=float, help="first outlier ejection time (default 10)")
    add(
        "--workers",
        type=_workers,
        help="data-plane processes on the port: N, or auto (the usable cores); default 1. "
        "See docs/performance.md for which N to choose",
    )
    add(
        "--shutdown-timeout-s",
        type=float,
        help="on SIGTERM, drain in-flight requests this long, then exit 0 (default 10)",
    )
    return p  # fmt: skip


def _choices(field: str) -> list[str]:
    """A Literal setting's values: the flag offers exactly what the setting accepts."""
    from gateway.config import Settings

    return [str(v) for v in get_args(Settings.model_fields[field].annotation)]


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def serve(argv: Sequence[str]) -> int:
    from gateway.http.server.signals import announce_signals

    announce_signals()  # first: no signal ends the gateway unannounced (docs/operations.md)
    from gateway.config import load_settings
    from gateway.logs import configure_logging

    args: dict[str, Any] = vars(_serve_parser().parse_args(argv))
    config_file = args.pop("config", None)
    try:
        settings = load_settings(args, config_file=config_file)
        _check_start(settings)
    except (ValueError, OSError) as exc:
        return _refuse(f"invalid configuration: {_describe(exc)}")
    if not (settings.replicas or settings.discovery_dns or settings.replicas_file):
        print(
            "rollout-gateway serve: give at least one --replica, --discovery-dns or "
            "--replicas-file",
            file=sys.stderr,
        )
        return 2
    workers = settings.worker_count()
    if workers > 1 and (settings.discovery_dns or settings.replicas_file):
        print("rollout-gateway serve: --workers above 1 needs a static --replica list "
              "(discovery is one-process only)", file=sys.stderr)  # fmt: skip
        return 2
    try:  # before anything is built: a port taken is the commonest start error
        sock = _listen(settings, reuse_port=workers > 1)
    except ValueError as exc:
        return _refuse(str(exc))
    configure_logging(settings.log_format, settings.log_level)
    if workers > 1:
        from gateway.supervisor import supervise

        return supervise(settings, workers, sock)
    from gateway.app import create_app  # here: a refused start never pays for its imports
    from gateway.http.server import serving

    app = create_app(settings)
    started = serving.serve(app, sock, lean=app.serve, stopping=app.stopping,
                            shutdown_timeout_s=settings.shutdown_timeout_s)  # fmt: skip
    return 0 if started else 3


def _refuse(message: str) -> int:
    """A start error: one line on stderr (an operator's mistake, not a bug: no
    traceback), exit status 2."""
    print(f"rollout-gateway serve: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _check_start(settings: Settings) -> None:
    """What ``Settings`` cannot check alone (the parts that own each format, the
    filesystem), so that a mistake stops the start instead of a traceback when the part
    first runs, or a 400 on every adapter load minutes later. ``ValueError`` naming the
    setting and the fix."""
    from gateway.adapters.naming import NamePattern
    from gateway.fleet.discovery import parse_dns_target, parse_hostport, parse_replicas_file
    from gateway.fleet.preflight import open_port_refusal
    from gateway.http.upstream import upstream_tls

    if refusal := open_port_refusal(settings):
        raise ValueError(refusal)
    for root in settings.adapter_roots:
        _check_root(root, "--adapter-root / GATEWAY_ADAPTER_ROOTS")
    for i, run in enumerate(settings.runs):
        _check_root(run.adapter_root, f"runs[{i}].adapter_root (run {run.name})")
    try:
        NamePattern(settings.adapter_name_pattern)
    except ValueError as exc:
        raise ValueError(f"adapter_name_pattern: {exc}") from None
    if settings.discovery_dns:
        parse_dns_target(settings.discovery_dns)
    if settings.discovery_nameserver:
        parse_hostport(settings.discovery_nameserver, what="discovery_nameserver")
    if settings.replicas_file:
        path = settings.replicas_file
        try:
            parse_replicas_file(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or exc.__class__.__name__
            raise ValueError(f"--replicas-file {path} cannot be read ({why}): give a "
                             "readable file (it may list no replica yet)") from None  # fmt: skip
        except ValidationError as exc:
            raise ValueError(f"--replicas-file {path}: {_describe(exc)}") from None
    if settings.upstream_ca_file:
        try:
            upstream_tls(settings)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise ValueError(f"--upstream-ca-file {settings.upstream_ca_file} holds no usable "
                             f"PEM certificate ({exc.__class__.__name__}): give a PEM CA "
                             "bundle") from None  # fmt: skip


def _check_root(root: Path, where: str) -> None:
    """An adapter root must be what ``lora_path`` can resolve inside on this host: else
    every adapter load is a 400 and TRL dies at its first weight sync."""
    if not root.is_absolute():
        raise ValueError(f"{where}: {root} is relative: give an absolute path (the replicas "
                         "read lora_path from their own working directory)")  # fmt: skip
    if not root.exists():
        raise ValueError(f"{where}: {root} does not exist: create it (TRL's output_dir), "
                         "or mount the adapter filesystem before the gateway starts")  # fmt: skip
    if not root.is_dir():
        raise ValueError(f"{where}: {root} is not a directory: give the directory TRL "
                         "saves adapters under")  # fmt: skip
    if not os.access(root, os.R_OK | os.X_OK):
        raise ValueError(f"{where}: {root} is not readable by uid {os.geteuid()}: make it "
                         "readable (the gateway resolves lora_path inside it)")  # fmt: skip


def _listen(settings: Settings, reuse_port: bool) -> socket.socket:
    """The listening socket, or ``ValueError`` naming the setting and the fix.
    ``reuse_port`` (``--workers N``): a plain bind first, since a ``SO_REUSEPORT`` bind
    succeeds beside another ``--workers`` gateway of this user on the same port, and the
    kernel would then split the clients between the two gateways."""
    from gateway.http.server import serving

    host, port = settings.host, settings.port
    try:
        if reuse_port and port:
            serving.listen_socket(host, port).close()
        return serving.listen_socket(host, port, reuse_port=reuse_port)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it ({exc.strerror}): give "
                         "an address of this machine, 0.0.0.0 or 127.0.0.1") from None  # fmt: skip
    except OSError as exc:
        fix = {
            errno.EADDRINUSE: f"--port {port}: {host}:{port} is already in use (another "
            "process listens there): stop it, or choose another --port",
            errno.EADDRNOTAVAIL: f"--host {host}: this machine has no such address: give one "
            "of its addresses, 0.0.0.0 (all) or 127.0.0.1",
            errno.EACCES: f"--port {port}: permission denied (ports below 1024 need "
            "privileges): choose a port above 1023",
            errno.EAFNOSUPPORT: f"--host {host}: this machine has no such address family "
            "(IPv6 off?): give an IPv4 address",
        }.get(exc.errno or 0, f"--host {host} --port {port}: cannot listen ({exc.strerror})")
        raise ValueError(fix) from None


def _describe(exc: ValueError | OSError) -> str:
    """The error without the offending *values*: they may be secrets (a token in the
    wrong field, a replica URL with a password)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors(include_input=False, include_url=False)
        )
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
        "serve": (serve, "run the gateway in front of N vLLM replicas"),
    }
    if argv and argv[0] in ("-V", "--version"):
        from gateway import __version__, build_commit

        print(f"rollout-gateway {__version__} (commit {build_commit()})")
        return 0
    if argv and argv[0] in _MOVED:
        print(f"rollout-gateway {argv[0]}: moved to `{_MOVED[argv[0]]}` (the rollout-testbed "
              "package: pip install ./testbed, or make venv)", file=sys.stderr)  # fmt: skip
        return 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        out = sys.stdout if asked else sys.stderr
        print("usage: rollout-gateway COMMAND [options]   (COMMAND --help for its options)\n",
              file=out)  # fmt: skip
        width = max(len(n) for n in commands)
        for name, (_, text) in commands.items():
            print(f"  {name:<{width}}  {text}", file=out)
        print("\nEvery serve flag also reads GATEWAY_<NAME> and the --config YAML file.", file=out)
        print("Simulated and local replicas, the demo: rollout-testbed --help.", file=out)
        print("rollout-gateway --version prints the version.", file=out)
        return 0 if asked else 2
    run, _ = commands[argv[0]]
    return run(argv[1:])
