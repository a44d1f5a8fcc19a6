"""Every start error an operator can cause is one line on stderr and exit status 2, naming
the setting and the fix, never a traceback: run through the real CLI
(``.venv/bin/rollout-gateway serve``), one process per mistake, in one process and with
``--workers 2`` where the two paths differ (the supervisor binds the port itself).

``CASES`` enumerates the mistakes, setting by setting. ``test_every_risky_setting_is_in_the
_table`` holds every ``Settings`` field that is a path, a secret, a list or a mapping, or a
text with a format of its own, to at least one row: a new setting of that kind fails it
until its mistakes are added here (and, likely, checked at start).

Secrets are refused by their *source* (``--api-key-file``, ``GATEWAY_API_KEY``, ``api_key
in the config file``...), never echoed. "Not readable" needs a process that file
permissions apply to: as root (a CI container), the gateway runs under ``setpriv`` without
``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import pytest

from gateway.config import Settings
from tests.conftest import CLIENT_KEY
from tests.deploy._proc import base_env

BIN = str(Path(sys.executable).parent / "rollout-gateway")
DEAD = "http://127.0.0.1:9"  # a replica URL nobody answers: starts are refused before it
pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Case:
    setting: str
    """The ``Settings`` field (or ``config``, ``<secret>_file``) the mistake is in."""
    id: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    expect: str = ""
    """A fragment of the one line: the setting as the operator spelled it, and the fix."""


R = ("--replica", DEAD)
EMPTY_KEY = "is empty: give the secret"
CASES = [
    # Secrets: empty or blank from every source, files that cannot be read.
    Case("api_key", "flag-empty", (*R, "--api-key", ""), expect=f"--api-key {EMPTY_KEY}"),
    Case("api_key", "flag-blank", (*R, "--api-key", "  "), expect=f"--api-key {EMPTY_KEY}"),
    Case("api_key", "env-empty", R, {"GATEWAY_API_KEY": ""}, f"GATEWAY_API_KEY {EMPTY_KEY}"),
    Case("api_key", "env-blank", R, {"GATEWAY_API_KEY": " \t"}, f"GATEWAY_API_KEY {EMPTY_KEY}"),
    Case("api_key", "yaml-empty", (*R, "--config", "{yaml_empty_key}"),
         expect=f"api_key in the config file {{yaml_empty_key}} {EMPTY_KEY}"),
    Case("api_key", "two-lines", (*R, "--api-key-file", "{two_lines}"),
         expect="--api-key-file ({two_lines}) holds a line break"),
    Case("api_key_file", "empty", (*R, "--api-key-file", "{empty}"),
         expect=f"--api-key-file ({{empty}}) {EMPTY_KEY}"),
    Case("api_key_file", "blank", (*R, "--api-key-file", "{blank}"),
         expect=f"--api-key-file ({{blank}}) {EMPTY_KEY}"),
    Case("api_key_file", "env-empty", R, {"GATEWAY_API_KEY_FILE": "{empty}"},
         f"GATEWAY_API_KEY_FILE ({{empty}}) {EMPTY_KEY}"),
    Case("api_key_file", "env-unset-path", R, {"GATEWAY_API_KEY_FILE": ""},
         f"GATEWAY_API_KEY_FILE {EMPTY_KEY}"),
    Case("api_key_file", "yaml-empty", (*R, "--config", "{yaml_empty_key_file}"),
         expect=f"api_key_file in the config file {{yaml_empty_key_file}} ({{empty}}) {EMPTY_KEY}"),
    Case("api_key_file", "missing", (*R, "--api-key-file", "{missing}"),
         expect="--api-key-file ({missing}): no such file; mount the secret there"),
    Case("api_key_file", "directory", (*R, "--api-key-file", "{dir}"),
         expect="--api-key-file ({dir}) is a directory: name the file in it"),
    Case("api_key_file", "unreadable", (*R, "--api-key-file", "{unreadable}"),
         expect="--api-key-file ({unreadable}) is not readable by uid"),
    Case("api_key_file", "not-utf8", (*R, "--api-key-file", "{binary}"),
         expect="--api-key-file ({binary}) is not UTF-8 text"),
    Case("admin_key", "env-empty", (*R, "--api-key", CLIENT_KEY), {"GATEWAY_ADMIN_KEY": ""},
         f"GATEWAY_ADMIN_KEY {EMPTY_KEY}"),
    Case("admin_key_file", "empty-beside-api-key",
         (*R, "--api-key", CLIENT_KEY, "--admin-key-file", "{empty}"),
         expect=f"--admin-key-file ({{empty}}) {EMPTY_KEY}"),
    Case("upstream_token", "flag-empty", (*R, "--upstream-token", ""),
         expect=f"--upstream-token {EMPTY_KEY}"),
    Case("upstream_token_file", "empty", R, {"GATEWAY_UPSTREAM_TOKEN_FILE": "{blank}"},
         f"GATEWAY_UPSTREAM_TOKEN_FILE ({{blank}}) {EMPTY_KEY}"),
    # Replicas: malformed JSON, bad URLs, a replica's own token.
    Case("replicas", "json", (), {"GATEWAY_REPLICAS": '["http://a:1"'},
         "GATEWAY_REPLICAS is not valid JSON (line 1, column 14)"),
    Case("replicas", "scheme", ("--replica", "ftp://a:1"), expect="must start with http://"),
    Case("replicas", "ipv6", ("--replica", "http://[::1"), expect="replica URL is malformed"),
    Case("replicas", "port", ("--replica", "http://a:99999"), expect="replica URL is malformed"),
    Case("replicas", "space", ("--replica", "http://a b:1"), expect="replica URL has no host"),
    Case("replicas", "token-empty", (), {"GATEWAY_REPLICAS": f'[{{"url": "{DEAD}", "token": ""}}]'},
         f"replicas.0.token: token {EMPTY_KEY}"),
    Case("replicas", "token-file-missing", (),
         {"GATEWAY_REPLICAS": f'[{{"url": "{DEAD}", "token_file": "{{missing}}"}}]'},
         "token_file ({missing}): no such file"),
    Case("replicas", "none", (), expect="give at least one --replica"),
    Case("replicas_file", "missing", ("--replicas-file", "{missing}"),
         expect="--replicas-file {missing} cannot be read"),
    Case("replicas_file", "directory", ("--replicas-file", "{dir}"),
         expect="--replicas-file {dir} cannot be read"),
    Case("replicas_file", "bad-url", ("--replicas-file", "{bad_replicas}"),
         expect="--replicas-file {bad_replicas}: url: replica URL must start with http://"),
    Case("discovery_dns", "no-port", ("--discovery-dns", "vllm"),
         expect="discovery_dns must be host:port"),
    Case("discovery_dns", "scheme", ("--discovery-dns", "ftp://vllm:1"),
         expect="discovery_dns scheme must be http or https"),
    Case("discovery_nameserver", "no-port",
         ("--discovery-dns", "vllm:1", "--discovery-nameserver", "ns"),
         expect="discovery_nameserver must be host:port"),
    # Runs and routing: malformed JSON, empty run keys, bad values.
    Case("runs", "json", R, {"GATEWAY_RUNS": '[{"name": "a"'},
         "GATEWAY_RUNS is not valid JSON"),
    Case("runs", "key-empty", R,
         {"GATEWAY_RUNS": '[{"name": "a", "key": " ", "adapter_root": "{dir}"}]'},
         f"runs.0.key: key {EMPTY_KEY}"),
    Case("runs", "key-file-empty", R,
         {"GATEWAY_RUNS": '[{"name": "a", "key_file": "{empty}", "adapter_root": "{dir}"}]'},
         f"runs.0: key_file ({{empty}}) {EMPTY_KEY}"),
    Case("runs", "root-missing", R,
         {"GATEWAY_RUNS": '[{"name": "a", "key": "k-a", "adapter_root": "{missing}"}]'},
         "runs[0].adapter_root (run a): {missing} does not exist"),
    Case("routing", "json", R, {"GATEWAY_ROUTING": '{"block_size": '},
         "GATEWAY_ROUTING is not valid JSON"),
    Case("routing", "value", R, {"GATEWAY_ROUTING": '{"block_size": "big"}'}, "routing:"),
    Case("routing", "not-a-mapping", R, {"GATEWAY_ROUTING": "[1]"},
         "routing: Input should be a valid dictionary"),
    # Adapter roots: missing, not a directory, not readable, relative, empty.
    Case("adapter_roots", "missing", (*R, "--adapter-root", "{missing}"),
         expect="--adapter-root / GATEWAY_ADAPTER_ROOTS: {missing} does not exist: create it"),
    Case("adapter_roots", "file", (*R, "--adapter-root", "{file}"),
         expect="{file} is not a directory"),
    Case("adapter_roots", "unreadable", (*R, "--adapter-root", "{closed_dir}"),
         expect="{closed_dir} is not readable by uid"),
    Case("adapter_roots", "relative", (*R, "--adapter-root", "adapters"),
         expect="adapters is relative: give an absolute path"),
    Case("adapter_roots", "env-empty", R, {"GATEWAY_ADAPTER_ROOTS": ""},
         "adapter_roots: names no directory"),
    Case("adapter_name_pattern", "regex", R, {"GATEWAY_ADAPTER_NAME_PATTERN": "("},
         "adapter_name_pattern: invalid adapter name pattern"),
    Case("adapter_name_pattern", "groups", R, {"GATEWAY_ADAPTER_NAME_PATTERN": "v(?P<version>1)"},
         "adapter_name_pattern: adapter name pattern"),
    Case("upstream_ca_file", "missing", (*R, "--upstream-ca-file", "{missing}"),
         expect="upstream_ca_file: upstream_ca_file"),
    Case("upstream_ca_file", "not-pem", (*R, "--upstream-ca-file", "{file}"),
         expect="--upstream-ca-file {file} holds no usable PEM certificate"),
    Case("request_id_headers", "not-a-header", R, {"GATEWAY_REQUEST_ID_HEADERS": "x id"},
         "request_id_headers: 'x id' is not a header name"),
    # Config files.
    Case("config", "missing", (*R, "--config", "{missing}"),
         expect="config file {missing} (--config / GATEWAY_CONFIG): no such file"),
    Case("config", "env-missing", R, {"GATEWAY_CONFIG": "{missing}"},
         "config file {missing} (--config / GATEWAY_CONFIG): no such file"),
    Case("config", "directory", (*R, "--config", "{dir}"), expect="is a directory"),
    Case("config", "unreadable", (*R, "--config", "{unreadable}"), expect="is not readable by uid"),
    Case("config", "bad-yaml", (*R, "--config", "{bad_yaml}"),
         expect="config file {bad_yaml} is not valid YAML (line 2)"),
    Case("config", "not-a-mapping", (*R, "--config", "{list_yaml}"),
         expect="config file {list_yaml} must hold a mapping"),
    # Where it listens: one process, and the supervisor of --workers 2.
    Case("port", "taken", (*R, "--port", "{taken}"),
         expect="--port {taken}: 127.0.0.1:{taken} is already in use"),
    Case("port", "taken-workers", (*R, "--port", "{taken}", "--workers", "2"),
         expect="--port {taken}: 127.0.0.1:{taken} is already in use"),
    Case("port", "taken-by-workers", (*R, "--port", "{taken_by_workers}", "--workers", "2"),
         expect="--port {taken_by_workers}: 127.0.0.1:{taken_by_workers} is already in use"),
    Case("port", "not-a-number", (*R, "--port", "eighty"),
         expect="argument --port: invalid int value: 'eighty' (see rollout-gateway serve --help)"),
    Case("workers", "not-a-number", (*R, "--workers", "many"),
         expect="argument --workers: expected a number or 'auto'"),
    Case("host", "not-here", (*R, "--host", "192.0.2.1", "--no-auth"),
         expect="--host 192.0.2.1: this machine has no such address"),
    Case("host", "not-here-workers", (*R, "--host", "192.0.2.1", "--no-auth", "--workers", "2"),
         expect="--host 192.0.2.1: this machine has no such address"),
    Case("host", "unresolvable", (*R, "--host", "no-such-host.invalid", "--no-auth"),
         expect="--host no-such-host.invalid: cannot resolve it"),
    Case("no_auth", "open-without-a-key", (*R, "--host", "0.0.0.0"),
         expect="--host 0.0.0.0 is not loopback and no client key is set: give --api-key-file"),
    Case("no_auth", "with-a-key", (*R, "--no-auth", "--api-key", CLIENT_KEY),
         expect="no_auth (--no-auth) contradicts the client keys"),
]  # fmt: skip

# Settings whose text has a format of its own (parsed by another part at start).
FORMATTED = {"host", "port", "discovery_dns", "discovery_nameserver", "adapter_name_pattern"}
RISKY_TYPES = (Path, list, dict)


def _risky(name: str) -> bool:
    """A path, a secret, a list or a mapping (a structured value), or a formatted text."""
    annotation = Settings.model_fields[name].annotation
    found: list[object] = [annotation]
    for arg in found:
        found.extend(get_args(arg))
    text = repr(annotation)
    return (
        name in FORMATTED
        or "SecretStr" in text
        or any(a in RISKY_TYPES or getattr(a, "__origin__", None) in RISKY_TYPES for a in found)
    )


def test_every_risky_setting_is_in_the_table() -> None:
    secrets_files = {f"{n}_file" for n in ("upstream_token", "api_key", "admin_key")}
    risky = {n for n in Settings.model_fields if _risky(n)} | secrets_files | {"config"}
    tested = {case.setting for case in CASES}
    assert risky - tested == set(), f"settings with no row in CASES: {sorted(risky - tested)}"
    assert tested <= {*Settings.model_fields, *secrets_files, "config"}, tested


def test_the_risk_rule_sees_paths_secrets_and_structures() -> None:
    """The table check is only as good as ``_risky``: it must flag each kind, and pass a
    plain number."""
    assert {n for n in ("replicas_file", "api_key", "runs", "routing", "adapter_roots",
                        "upstream_ca_file", "replicas") if _risky(n)} == {
        "replicas_file", "api_key", "runs", "routing", "adapter_roots", "upstream_ca_file",
        "replicas"}  # fmt: skip
    assert not _risky("max_staleness") and not _risky("health_interval_s")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    d = tmp_path_factory.mktemp("start-errors")
    (d / "empty").write_text("")
    (d / "blank").write_text("  \n\n")
    (d / "two_lines").write_text("sk-one\nsk-two\n")
    (d / "binary").write_bytes(b"\xff\xfe\x00")
    (d / "file").write_text("not a directory, not a certificate\n")
    (d / "dir").mkdir()
    (d / "unreadable").write_text(f"{CLIENT_KEY}\n")
    (d / "unreadable").chmod(0)
    (d / "closed_dir").mkdir()
    (d / "closed_dir").chmod(0)
    (d / "bad_yaml").write_text("replicas: [http://a:1]\nport: 1: 2\n")
    (d / "list_yaml").write_text("- http://a:1\n")
    (d / "bad_replicas").write_text("- ftp://a:1\n")
    (d / "yaml_empty_key").write_text('api_key: ""\n')
    (d / "yaml_empty_key_file").write_text(f"api_key_file: {d / 'empty'}\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    # As another ``--workers N`` gateway of this user holds its port: SO_REUSEPORT.
    by_workers = socket.socket()
    by_workers.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    by_workers.bind(("127.0.0.1", 0))
    by_workers.listen(1)
    names = {p.name: str(p) for p in d.iterdir()}
    ports = {"taken": taken, "taken_by_workers": by_workers}
    yield {
        **names,
        "missing": str(d / "missing"),
        **{name: str(sock.getsockname()[1]) for name, sock in ports.items()},
    }
    taken.close()
    by_workers.close()
    (d / "closed_dir").chmod(0o700)


def _format(text: str, files: dict[str, str]) -> str:
    for name, value in files.items():
        text = text.replace("{" + name + "}", value)
    return text


def _as_user_bound_by_permissions() -> list[str]:
    """Root ignores file modes: run it without the two capabilities that let it."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.setting}-{c.id}" for c in CASES])
def test_a_start_error_is_one_line_and_exit_2(case: Case, files: dict[str, str]) -> None:
    argv = [*_as_user_bound_by_permissions(), BIN, "serve", *(_format(a, files) for a in case.args)]
    env = base_env({k: _format(v, files) for k, v in case.env.items()})
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=files["dir"])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("rollout-gateway serve: "), lines
    assert _format(case.expect, files) in lines[0], lines[0]
    assert CLIENT_KEY not in r.stderr + r.stdout
