"""Gateway configuration: one frozen, validated ``Settings`` object built once at startup.

Precedence (highest first): command-line flags, ``GATEWAY_*`` environment variables, the
YAML config file (``--config`` / ``GATEWAY_CONFIG``), then the defaults below. Nothing else
in the package reads ``os.environ``.

A ``GATEWAY_*`` variable or YAML key that is no setting fails start, naming the closest
known one: a typo'd ``GATEWAY_MAX_STALNESS`` would silently keep the default window.

Secrets (``upstream_token``, ``api_key``, ``admin_key``) are ``SecretStr`` so they never
show up in reprs, logs or ``/gateway/status``; each can also be read from a file
(``--api-key-file``, ``GATEWAY_API_KEY_FILE``...), which is how Kubernetes and HF Jobs
mount them. One precedence for both forms: the highest layer naming a secret (as a value
or as a file) wins, and lower layers' forms are dropped unread. Replicas may carry their
own token (YAML ``{url, token | token_file}``), which wins over ``upstream_token``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway.routing.config import RoutingConfig

__all__ = [
    "ReplicaSpec",
    "RunSet",
    "RunSpec",
    "Settings",
    "config_stamp",
    "load_settings",
    "reread_runs",
]

_SECRET_FIELDS = ("upstream_token", "api_key", "admin_key")
_FILE_FORMS = tuple(f"{name}_file" for name in _SECRET_FIELDS)
_NO_EMPTY = frozenset((*_SECRET_FIELDS, *_FILE_FORMS, "adapter_roots"))


def _check_names(names: Iterable[str], known: Iterable[str], where: str) -> None:
    """Refuse names that are no setting, each shown with the closest known one."""
    choices = sorted(known)
    if unknown := sorted(set(names) - set(choices)):
        close = {n: difflib.get_close_matches(n, choices, n=1, cutoff=0.6) for n in unknown}
        hints = [repr(n) + (f" (did you mean {c[0]!r}?)" if c else "") for n, c in close.items()]
        raise ValueError(f"unknown {where}: {', '.join(hints)}; see docs/configuration.md")


def _check_keys(value: Any, known: Iterable[str], where: str) -> None:
    if isinstance(value, Mapping):
        _check_names(map(str, value), known, where)


def _check_secret(value: str, where: str) -> str:
    """``value`` unless it cannot be a key: an empty key must never read as "no key"
    (which is "no auth" for the client and admin keys), and a line break in one is a
    mangled file. ``ValueError`` naming ``where`` (the setting and its source), never the
    value."""
    if not value.strip():
        raise ValueError(f"{where} is empty: give the secret, or remove the setting (no key "
                         "is no auth: docs/configuration.md, \"Secrets\")")  # fmt: skip
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{where} holds a line break or control character: a secret is "
                         "one line")  # fmt: skip
    return value


def _read_secret_file(path: Any, where: str) -> str:
    """Read a one-line secret file; trailing newlines are a mounting artefact, not data.
    Each way it can fail is a ``ValueError`` naming ``where``, the path and the fix."""
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"{where} must be a path (a string)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{where} ({path}): no such file; mount the secret there or fix "
                         "the path") from None  # fmt: skip
    except IsADirectoryError:
        raise ValueError(f"{where} ({path}) is a directory: name the file in it") from None
    except PermissionError:
        raise ValueError(f"{where} ({path}) is not readable by uid {os.geteuid()}: make it "
                         "readable (the image runs as uid 10001)") from None  # fmt: skip
    except UnicodeDecodeError:
        raise ValueError(f"{where} ({path}) is not UTF-8 text") from None
    except OSError as exc:
        raise ValueError(f"{where} ({path}) cannot be read: {exc.strerror}") from None
    return _check_secret(text.strip(), f"{where} ({path})")


def _structured(value: Any, where: str) -> Any:
    """A structured setting given as text (JSON in ``GATEWAY_REPLICAS``, ``GATEWAY_RUNS``,
    ``GATEWAY_ROUTING``; YAML is accepted too) parsed, or ``ValueError`` with the place
    of the mistake (never the text: a run's key may be in it)."""
    if not isinstance(value, str):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"{where} is not valid JSON{at}: check its brackets, commas and "
                         "quotes") from None  # fmt: skip


class ReplicaSpec(BaseModel):
    """One upstream vLLM server. The URL may hold credentials; it is never echoed back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    token: SecretStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"url": value}
        _check_keys(value, ("url", "token", "token_file"), "replica key")
        if isinstance(value, Mapping) and "token_file" in value:
            data = {k: v for k, v in value.items() if k != "token_file"}
            data.setdefault("token", _read_secret_file(value["token_file"], "token_file"))
            return data
        return value

    @field_validator("token")
    @classmethod
    def _check_token(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None:
            _check_secret(token.get_secret_value(), "token")
        return token

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError("replica URL must start with http:// or https://")
        # What urllib and yarl would raise later, as a traceback, now: the URL itself is
        # never echoed (it may hold a password).
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (raises on a port out of range or not a number)
        except ValueError as exc:
            raise ValueError(f"replica URL is malformed ({exc}): give scheme://host:port") from None
        if not parts.hostname or any(c.isspace() or ord(c) < 32 for c in url):
            raise ValueError("replica URL has no host, or a space in it: give scheme://host:port")
        return url


class RunSpec(BaseModel):
    """One training run sharing the fleet (docs/many-runs.md): who it is (its key), where
    its adapters may come from, how many versions it keeps, and its share of the load."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,31}$")
    key: SecretStr
    adapter_root: Path
    max_staleness: int = Field(4, ge=0)
    max_in_flight: int | None = Field(None, ge=1)
    remove_grace_s: float = Field(30.0, ge=0)
    """Once a reload removed it: its rollouts in flight may finish this long, then are
    aborted (503), before its adapters are unloaded."""
    key_overlap_s: float = Field(60.0, ge=0)
    """Once a reload rotated its key: the old key keeps working this long."""
    weight: float = Field(1.0, gt=0, le=1000)
    """Its share of a saturated replica's slots, against the other runs homed there
    (``replica_capacity``; docs/many-runs.md, "Fair share under saturation")."""

    @model_validator(mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        _check_keys(value, [*cls.model_fields, "key_file"], "run key")
        if isinstance(value, Mapping) and "key_file" in value:
            data = {k: v for k, v in value.items() if k != "key_file"}
            data.setdefault("key", _read_secret_file(value["key_file"], "key_file"))
            return data
        return value

    @field_validator("key")
    @classmethod
    def _check_key(cls, key: SecretStr) -> SecretStr:
        _check_secret(key.get_secret_value(), "key")  # an empty key would let anyone in
        return key


class Settings(BaseSettings):
    """Every tunable of ``rollout-gateway serve``; see docs/configuration.md."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", frozen=True, extra="forbid")

    replicas: Annotated[list[ReplicaSpec], NoDecode] = Field(
        default_factory=list, description="Upstream vLLM base URLs (repeat --replica)."
    )
    discovery_dns: str | None = Field(
        None,
        description="[scheme://]name:port of a DNS name (e.g. a Kubernetes headless Service) "
        "whose A/AAAA records are replicas; re-resolved every discovery_interval_s.",
    )
    discovery_nameserver: str | None = Field(
        None, description="host:port of a DNS server to query instead of the system resolver."
    )
    replicas_file: Path | None = Field(
        None, description="File listing replicas; re-read on change or SIGHUP."
    )
    discovery_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often DNS is re-resolved and the replicas file checked (and, "
        "with runs, the config file for a changed run set).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    upstream_token: SecretStr | None = Field(
        None, description="Sent upstream as 'Authorization: Bearer <token>' (e.g. an HF token)."
    )
    api_key: SecretStr | None = Field(
        None, description="If set, clients must send 'Authorization: Bearer <key>'."
    )
    admin_key: SecretStr | None = Field(
        None, description="If set, load/unload/pause/resume/reset also require this key."
    )
    no_auth: bool = Field(
        False,
        description="Serve clients that present no key on a non-loopback address: the "
        "explicit choice of no auth (without it, such a start is refused).",
    )
    max_staleness: int = Field(4, ge=0, description="Adapter versions kept per family: S+1.")
    adapter_roots: list[Path] = Field(
        default_factory=list, description="lora_path must resolve inside one of these."
    )
    runs: Annotated[list[RunSpec], NoDecode] = Field(
        default_factory=list,
        description="Training runs sharing the fleet, each with its own key, adapter names, "
        "staleness window and pause (docs/many-runs.md); none: single-run mode.",
    )
    lora_slots_per_replica: int | None = Field(
        None,
        ge=1,
        description="Adapter budget of each replica for placing runs (default: the weakest "
        "replica's max_loras from /server_info).",
    )
    run_pause: Literal["scoped", "fleet"] = Field(
        "scoped",
        description="A run's /pause: hold only its own rollouts (scoped), or pause every "
        "replica for everyone (fleet, the naive global pause).",
    )
    replica_capacity: int = Field(
        256,
        ge=1,
        description="Rollouts one replica runs at once: its vLLM --max-num-seqs (vLLM's "
        "default is 256). With runs, the gateway holds what exceeds it and releases it in "
        "weighted fair order (docs/many-runs.md).",
    )
    fair_wait_s: float = Field(
        30.0,
        gt=0,
        description="With runs: the longest a rollout is held for a free slot; then it is "
        "sent anyway (counted in gateway_run_fair_overflows_total).",
    )
    fair_idle_s: float = Field(
        60.0,
        ge=0,
        description="With runs: how long a run keeps its guaranteed share of a replica "
        "after its last rollout there ended (a GRPO run between two steps).",
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="stdlib logging level."
    )
    request_id_headers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["x-request-id"],
        min_length=1,
        description="Request headers a client's request id is read from, the first present "
        "and sane one wins (else the gateway makes one); it is sent to replicas and answered "
        "as X-Request-Id, and tags every log line of the request.",
    )
    router: Literal["prefix", "least_loaded", "round_robin", "random"] = Field(
        "prefix", description="Routing policy: prefix, least_loaded, round_robin or random."
    )
    routing: dict[str, Any] = Field(
        default_factory=dict,
        description="RoutingConfig overrides, e.g. {block_size: 32, load_epsilon: 0.25} "
        "(see docs/routing.md); JSON in GATEWAY_ROUTING.",
    )

    # Adapter lifecycle (see docs/adapters.md).
    adapter_name_pattern: str = Field(
        r"^(?P<family>.+)-v(?P<version>\d+)$",
        description="Regex with named groups 'family' and 'version' for versioned adapters.",
    )
    adapter_load_deadline_s: float = Field(
        300.0, gt=0, description="Retry 'No adapter found' (mount lag) this long, then 504."
    )
    adapter_retry_initial_s: float = Field(0.5, gt=0, description="First mount-lag backoff.")
    adapter_retry_max_s: float = Field(2.0, gt=0, description="Largest mount-lag backoff.")
    adapter_unload_grace_s: float = Field(
        5.0, ge=0, description="Max wait for in-flight requests before an unload is applied."
    )
    adapter_audit_interval_s: float = Field(
        30.0, gt=0, description="Compare healthy replicas' adapters with the registry (±20%)."
    )

    # Health checking and ejection.
    health_interval_s: float = Field(2.0, gt=0, description="Active /health probe period.")
    health_timeout_s: float = Field(2.0, gt=0, description="Timeout of one health probe.")
    unhealthy_threshold: int = Field(2, ge=1, description="Failed probes before ejection.")
    healthy_threshold: int = Field(1, ge=1, description="Good probes before re-admission.")
    health_min_replicas: int | None = Field(
        None,
        ge=1,
        description="Degraded mode: /health is 200 with at least this many replicas up "
        "(default: all of them).",
    )

    # Upstream HTTP.
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect timeout.")
    read_timeout_s: float = Field(600.0, gt=0, description="Max gap between upstream reads.")
    broadcast_timeout_s: float = Field(120.0, gt=0, description="Per-replica fan-out timeout.")
    max_connections: int = Field(
        1024, ge=1, description="Upstream connections per replica (each client, each replica)."
    )
    upstream_ca_file: Path | None = Field(
        None, description="PEM CA bundle that verifies https replicas (default: the system's)."
    )
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="Request body limit.")
    max_header_bytes: int = Field(
        16 * 1024, ge=256, description="Total request header bytes (names + values); 431 above."
    )
    max_header_count: int = Field(100, ge=8, description="Request headers; 431 above.")
    max_json_depth: int = Field(
        32, ge=2, description="Nesting depth of a JSON body (objects + arrays); 400 above."
    )
    max_n: int | None = Field(
        256, ge=1, description="Largest 'n' (samples per prompt) accepted; 400 above."
    )
    max_tokens_limit: int | None = Field(
        None, ge=1, description="Largest 'max_tokens' / 'max_completion_tokens'; 400 above."
    )
    max_in_flight: int | None = Field(
        4096, ge=1, description="Proxied requests in flight; 429 + Retry-After above."
    )
    max_in_flight_per_client: int | None = Field(
        None, ge=1, description="Proxied requests in flight per client; 429 + Retry-After."
    )

    # Passive outlier detection, retry budget.
    outlier_consecutive_errors: int = Field(
        5, ge=0, description="5xx/429 answers in a row that eject a replica (0: off)."
    )
    outlier_ejection_s: float = Field(
        10.0, gt=0, description="First outlier ejection; doubles on each re-ejection."
    )
    outlier_max_ejection_s: float = Field(300.0, gt=0, description="Longest outlier ejection.")
    outlier_max_ejected_fraction: float = Field(
        0.5, ge=0, le=1, description="Share of replicas outlier detection may eject at once."
    )
    retry_budget_ratio: float = Field(
        0.2, ge=0, description="Retries allowed per request over a 10 s window."
    )
    retry_budget_min_per_s: float = Field(
        10.0, ge=0, description="Retries per second always allowed."
    )
    shutdown_timeout_s: int = Field(
        10, ge=0, description="On SIGTERM: drain in-flight requests this long, then exit 0."
    )
    workers: int | Literal["auto"] = Field(
        1,
        description="Data-plane processes accepting on the port (1: one process, as before; "
        "auto: the cores this process may use). See docs/performance.md.",
    )

    @field_validator("workers")
    @classmethod
    def _check_workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 256:
            raise ValueError("workers must be 1..256 or 'auto'")
        return value

    def worker_count(self) -> int:
        """``workers`` resolved: ``auto`` is the CPUs this process may run on."""
        if self.workers == "auto":
            return max(1, len(os.sched_getaffinity(0)))
        return int(self.workers)

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        """Accept a JSON list (env/YAML) or a comma-separated string (env)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return _structured(text, "GATEWAY_REPLICAS")
            return [part for part in (p.strip() for p in text.split(",")) if part]
        return value

    @field_validator("runs", mode="before")
    @classmethod
    def _parse_runs(cls, value: Any) -> Any:
        return _structured(value, "GATEWAY_RUNS")

    @field_validator("upstream_token", "api_key", "admin_key")
    @classmethod
    def _no_empty_secret(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        """However ``Settings`` is built: an empty key is refused, never "no key"."""
        if value is not None:
            _check_secret(value.get_secret_value(), str(info.field_name))
        return value

    _source: _FileSource | None = PrivateAttr(None)
    """The config file as read at start (``load_settings``): what a reload re-reads."""

    @model_validator(mode="after")
    def _check_runs(self) -> Settings:
        _check_run_set(self.runs, self.api_key)
        if self.no_auth and (self.api_key or self.runs):
            raise ValueError("no_auth (--no-auth) contradicts the client keys that are set "
                             "(api_key or runs): drop one")  # fmt: skip
        if self.workers != 1 and (self.discovery_dns or self.replicas_file):
            raise ValueError("workers > 1 needs a static replica list (no discovery yet)")
        return self

    @field_validator("upstream_ca_file")
    @classmethod
    def _ca_file_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"upstream_ca_file {str(path)!r} is not a file")
        return path

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("request_id_headers", mode="before")
    @classmethod
    def _check_request_id_headers(cls, value: Any) -> Any:
        names = value.split(",") if isinstance(value, str) else value
        if not isinstance(names, list):
            return names
        names = [n.strip().lower() if isinstance(n, str) else n for n in names]
        for name in names:
            if not isinstance(name, str) or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9a-z-]+", name):
                raise ValueError(f"request_id_headers: {name!r} is not a header name")
        return names

    @field_validator("routing", mode="before")
    @classmethod
    def _parse_routing(cls, value: Any) -> Any:  # checked now, not when routing starts
        value = _structured(value, "GATEWAY_ROUTING")
        _check_keys(value, [f.name for f in dataclasses.fields(RoutingConfig)], "routing key")
        if isinstance(value, Mapping):
            try:
                RoutingConfig(**value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{exc}; see docs/routing.md") from None
        return value

    @field_validator("adapter_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        roots = [p for p in value.split(os.pathsep) if p.strip()]
        if not roots:  # "no roots" means any lora_path: never by an empty variable
            raise ValueError(f"names no directory: give DIR[{os.pathsep}DIR...], or leave "
                             "GATEWAY_ADAPTER_ROOTS unset to accept any lora_path")  # fmt: skip
        return roots

    def token_for(self, index: int) -> SecretStr | None:
        """The bearer token for replica ``index``: its own, else the global one."""
        return self.replicas[index].token or self.upstream_token


def _check_run_set(runs: Iterable[RunSpec], api_key: SecretStr | None) -> None:
    """The run set as a whole: names and keys unique, no ``api_key`` beside it."""
    runs = list(runs)
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique: {names}")
    keys = [r.key.get_secret_value() for r in runs]
    if len(set(keys)) != len(keys):
        raise ValueError("every run needs its own key (a key identifies the run)")
    if runs and api_key is not None:
        raise ValueError("api_key and runs exclude each other: each run has its own key")


@dataclasses.dataclass(frozen=True)
class _FileSource:
    path: Path
    data: Mapping[str, Any]
    """The file's settings as read at start (raw): a reload warns of those that changed."""
    runs_from_file: bool
    """Whether ``runs`` (and ``lora_slots_per_replica``) came from the file: a flag or
    the environment above it wins, and a reload of the file could not change them."""


@dataclasses.dataclass(frozen=True)
class RunSet:
    """The run set a reload re-read from the config file, validated as at start."""

    runs: tuple[RunSpec, ...]
    lora_slots_per_replica: int | None
    ignored: tuple[str, ...]
    """Other settings that changed in the file: a reload does not apply them."""


_RELOADED = ("runs", "lora_slots_per_replica")
_RUN_LIST = TypeAdapter(list[RunSpec])
_SLOTS = TypeAdapter(Annotated[int | None, Field(ge=1)])


def _read_file(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ValueError(f"config file {path} (--config / GATEWAY_CONFIG): no such file; "
                         "fix the path") from None  # fmt: skip
    except IsADirectoryError:
        raise ValueError(f"config file {path} (--config / GATEWAY_CONFIG) is a directory: "
                         "name the YAML file in it") from None  # fmt: skip
    except PermissionError:
        raise ValueError(f"config file {path} (--config / GATEWAY_CONFIG) is not readable "
                         f"by uid {os.geteuid()}: make it readable") from None  # fmt: skip
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not UTF-8 text") from None
    except yaml.YAMLError as exc:  # its text may quote a line holding a key: never shown
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path} must hold a mapping (setting: value lines), "
                         f"not a {type(loaded).__name__}")  # fmt: skip
    data = {str(k).replace("-", "_"): v for k, v in loaded.items()}
    _check_keys(data, [*Settings.model_fields, *_FILE_FORMS], f"setting in {path}")
    return data


def _errors(exc: ValidationError, where: str) -> str:
    """A validation error without the values it refused (a key may be one)."""
    found = []
    for e in exc.errors(include_url=False, include_input=False, include_context=False):
        at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"])
        found.append(f"{where}{at}: {e['msg']}")
    return "; ".join(found)


def config_stamp(settings: Settings) -> tuple[int, int, int] | None:
    """The config file's (modification time, size, checksum) now, if the runs came from
    it (a reload is due when it changes); None if there is none or it cannot be read."""
    source = settings._source
    if source is None or not source.runs_from_file:
        return None
    try:
        stat = source.path.stat()
        content = source.path.read_bytes()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, zlib.crc32(content)


def current_runs(settings: Settings) -> Settings:
    """``settings`` with the config file's run set as it is now, when the runs were read
    from it: the owner process that ``serve --workers N`` restarts must not bring back the
    run set of the gateway's start after reloads changed it. The given settings when the
    file's set cannot be used (the owner before the restart had refused it too)."""
    source = settings._source
    if source is None or not source.runs_from_file:
        return settings
    try:
        found = reread_runs(settings)
    except ValueError:
        return settings
    update: dict[str, object] = {"runs": list(found.runs)}
    if found.lora_slots_per_replica is not None:
        update["lora_slots_per_replica"] = found.lora_slots_per_replica
    return settings.model_copy(update=update)


def reread_runs(settings: Settings) -> RunSet:
    """The config file's ``runs:`` and ``lora_slots_per_replica`` now, validated as at
    start (each run, then the set: names and keys unique); ``ValueError`` naming the
    problem (never a key) if the set cannot be used."""
    source = settings._source
    if source is None:
        raise ValueError("the runs were not read from a config file: a reload needs one "
                         "(--config / GATEWAY_CONFIG) holding runs:")  # fmt: skip
    if not source.runs_from_file:
        raise ValueError("runs are set by a flag or the environment, which a reload cannot "
                         "re-read: set them in the config file to reload them")  # fmt: skip
    try:
        data = _read_file(source.path)
    except OSError as exc:
        raise ValueError(f"cannot read config file {source.path}: {exc.strerror}") from None
    if "runs" not in data:
        raise ValueError(f"config file {source.path} has no runs: (an empty list removes "
                         "every run; leaving it out is taken for a mistake)")  # fmt: skip
    try:
        runs = _RUN_LIST.validate_python(data["runs"] or [])
    except ValidationError as exc:
        raise ValueError(_errors(exc, "runs")) from None
    try:
        slots = _SLOTS.validate_python(data.get("lora_slots_per_replica"))
    except ValidationError as exc:
        raise ValueError(_errors(exc, "lora_slots_per_replica")) from None
    if not runs:
        raise ValueError("runs: is empty: a multi-run gateway keeps at least one run "
                         "(single-run mode needs a restart)")  # fmt: skip
    _check_run_set(runs, settings.api_key)
    before = {k: v for k, v in source.data.items() if k not in _RELOADED}
    after = {k: v for k, v in data.items() if k not in _RELOADED}
    ignored = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return RunSet(tuple(runs), slots, tuple(ignored))


def _env_values(environ: Mapping[str, str]) -> dict[str, str]:
    """``GATEWAY_<FIELD>`` (and ``GATEWAY_<SECRET>_FILE``) values, as raw strings; an
    unknown ``GATEWAY_*`` name is an error (its value is never echoed: it may be a secret)."""
    names = [*Settings.model_fields, *_FILE_FORMS]
    known = {f"GATEWAY_{name.upper()}" for name in names} | {"GATEWAY_CONFIG"}
    _check_names([k for k in environ if k.startswith("GATEWAY_")], known, "environment variable")
    # Empty is "unset", except where unset opens a door (no key: no auth; no root: any
    # lora_path): there an empty variable (a shell's unset $KEY) is refused by the checks.
    return {
        name: value
        for name in names
        if (value := environ.get(f"GATEWAY_{name.upper()}")) or (value == "" and name in _NO_EMPTY)
    }


def _pick_secrets(layers: Mapping[str, dict[str, Any]]) -> None:
    """One precedence for ``<secret>`` and ``<secret>_file`` alike: the highest layer giving
    either form wins (its file is read); lower layers' forms are dropped unread. Both forms
    in one layer are ambiguous: an error."""
    for name in _SECRET_FIELDS:
        file_key, chosen = f"{name}_file", False
        for where, layer in layers.items():
            value, path = layer.pop(name, None), layer.pop(file_key, None)
            for key, given in ((name, value), (file_key, path)):
                if given is not None and not isinstance(given, str):  # shadowed or not
                    raise ValueError(f"{key} given by {where} must be a string (quote it)")
                if given is not None:  # an empty one is a mistake, shadowed or not
                    _check_secret(given, _origin(where, key))
            if chosen or (value is None and path is None):
                continue
            if value is not None and path is not None:
                raise ValueError(f"{name} and {file_key} are both set by {where}; give one")
            read = value if value is not None else _read_secret_file(path, _origin(where, file_key))
            layer[name] = read
            chosen = True


def _origin(where: str, key: str) -> str:
    """How the operator spelled ``key`` in layer ``where``: what an error must name."""
    return {
        "flags": f"--{key.replace('_', '-')}",
        "the environment": f"GATEWAY_{key.upper()}",
    }.get(where, f"{key} in {where}")


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build ``Settings`` from flags (``overrides``), env, YAML file and defaults.

    ``environ`` defaults to ``os.environ``; tests pass their own mapping.
    """
    env = os.environ if environ is None else environ
    flag_data = dict(overrides or {})
    env_data: dict[str, Any] = dict(_env_values(env))
    path = config_file or env.get("GATEWAY_CONFIG")
    file_data: dict[str, Any] = {}
    source = None
    if path:
        file_data = _read_file(Path(path))
        shadowed = any(k in layer for layer in (flag_data, env_data) for k in _RELOADED)
        runs_from_file = "runs" in file_data and not shadowed
        source = _FileSource(Path(path), dict(file_data), runs_from_file)
    _pick_secrets({"flags": flag_data, "the environment": env_data,
                   f"the config file {path}": file_data})  # fmt: skip

    class _Sourced(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            # Explicit sources instead of pydantic-settings' own env reader, so tests can
            # pass an environment; secrets were settled across layers by _pick_secrets.
            return (
                init_settings,
                InitSettingsSource(settings_cls, env_data),
                InitSettingsSource(settings_cls, file_data),
            )

    settings = _Sourced(**flag_data)
    settings._source = source
    return settings
