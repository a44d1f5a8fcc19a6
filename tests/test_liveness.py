"""The image's HEALTHCHECK probe (``gateway/http/liveness.py``): the kernel's socket table
read right, on real listening sockets of real child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gateway.http import liveness
from gateway.http.liveness import listening_urls, process_tree

PY = sys.executable
# A parent that listens on nothing and a child that listens on HOST: the probe must look
# through the tree, as it does for serve --workers N.
_SERVE = """
import http.server, subprocess, sys
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[3]])
    sys.exit(child.wait())
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/livez" else 404); self.end_headers()
    def log_message(self, *a): pass
family = __import__("socket").AF_INET6 if ":" in sys.argv[2] else __import__("socket").AF_INET
http.server.HTTPServer.address_family = family
server = http.server.HTTPServer((sys.argv[2], 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.fixture
def tree(request: pytest.FixtureRequest) -> Iterator[tuple[int, int]]:
    """(parent pid, child's port) for a child listening on ``request.param``."""
    proc = subprocess.Popen([PY, "-c", _SERVE, "parent", _SERVE, request.param],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc.pid, port
    finally:
        for pid in reversed(process_tree(proc.pid)):  # ours: the child, then the parent
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize(
    ("tree", "shown"),
    [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::1", "[::1]"), ("::", "[::1]")],
    indirect=["tree"],
)
def test_the_listening_address_of_a_descendant(tree: tuple[int, int], shown: str) -> None:
    pid, port = tree
    assert listening_urls(pid) == [f"http://{shown}:{port}"]
    assert liveness.main(["--pid", str(pid)]) == 0


def test_no_listener_is_unhealthy(capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    try:
        assert listening_urls(proc.pid) == []
        assert liveness.main(["--pid", str(proc.pid)]) == 1
        assert "listen on no TCP port" in capsys.readouterr().err
    finally:
        proc.kill()
        proc.wait(10)


def test_addresses_decode_as_the_kernel_writes_them() -> None:
    assert liveness._address("0100007F") == "127.0.0.1"
    assert liveness._address("00000000000000000000000001000000") == "::1"
    assert liveness._url("::ffff:10.0.0.5", 8000) == "http://10.0.0.5:8000"
    assert liveness._url("10.0.0.5", 80) == "http://10.0.0.5:80"
