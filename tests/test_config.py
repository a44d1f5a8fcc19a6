from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from gateway.config import Settings, load_settings
from gateway.routing.policy import ROUTERS


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("port: 7000\nmax_staleness: 1\nlog_format: json\nreplicas: [http://f:1]\n")
    env = {"GATEWAY_PORT": "7100", "GATEWAY_MAX_STALENESS": "2"}
    s = load_settings({"port": 7200}, config_file=cfg, environ=env)
    assert s.port == 7200  # flag
    assert s.max_staleness == 2  # env over file
    assert s.log_format == "json"  # file over default
    assert [r.url for r in s.replicas] == ["http://f:1"]


def test_config_file_from_env(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("port: 7001\n")
    assert load_settings({}, environ={"GATEWAY_CONFIG": str(cfg)}).port == 7001


@pytest.mark.parametrize(
    "value", ["http://a:1,http://b:2", '["http://a:1", "http://b:2"]', " http://a:1/ , http://b:2"]
)
def test_replicas_from_env(value: str) -> None:
    s = load_settings({}, environ={"GATEWAY_REPLICAS": value})
    assert [r.url for r in s.replicas] == ["http://a:1", "http://b:2"]


def test_secrets_from_files_and_never_in_repr(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("hf_secret_token\n")
    key = tmp_path / "key"
    key.write_text("client-key")
    s = load_settings(
        {"upstream_token_file": str(token)}, environ={"GATEWAY_API_KEY_FILE": str(key)}
    )
    assert s.upstream_token is not None and s.api_key is not None
    assert s.upstream_token.get_secret_value() == "hf_secret_token"
    assert s.api_key.get_secret_value() == "client-key"
    assert "hf_secret_token" not in repr(s) and "client-key" not in repr(s)


def test_explicit_secret_beats_lower_layer_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("from-file")
    s = load_settings({"api_key": "from-flag"}, environ={"GATEWAY_API_KEY_FILE": str(key)})
    assert s.api_key is not None and s.api_key.get_secret_value() == "from-flag"


def test_per_replica_token(tmp_path: Path) -> None:
    tok = tmp_path / "t1"
    tok.write_text("replica-one")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"replicas:\n  - http://a:1\n  - {{url: 'http://b:2', token_file: '{tok}'}}\n")
    s = load_settings({"upstream_token": "global"}, config_file=cfg, environ={})
    assert s.token_for(0) is not None and s.token_for(0).get_secret_value() == "global"  # type: ignore[union-attr]
    assert s.token_for(1).get_secret_value() == "replica-one"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"replicas": ["ftp://x"]}, "replicas"),
        ({"port": 70000}, "port"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"log_format": "xml"}, "log_format"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_invalid_settings_are_rejected(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        load_settings(overrides, environ={})
    assert field in str(info.value)


# --- mistakes fail at start, naming the closest setting -----------------------------------


def test_unknown_env_variable_names_the_closest_and_hides_its_value() -> None:
    env = {"GATEWAY_MAX_STALNESS": "sk-TESTSECRET-value", "GATEWAY_REPLICAS": "http://a:1"}
    with pytest.raises(ValueError) as info:
        load_settings({}, environ=env)
    message = str(info.value)
    assert "'GATEWAY_MAX_STALNESS' (did you mean 'GATEWAY_MAX_STALENESS'?)" in message
    assert "sk-TESTSECRET-value" not in message


def test_every_unknown_env_variable_is_named_at_once() -> None:
    env = {"GATEWAY_PROT": "1", "GATEWAY_ZZZZZZZZ": "1", "GATEWAY_API_KEY_FLIE": "/x"}
    with pytest.raises(ValueError) as info:
        load_settings({}, environ=env)
    message = str(info.value)
    assert "'GATEWAY_PROT' (did you mean 'GATEWAY_PORT'?)" in message
    assert "'GATEWAY_API_KEY_FLIE' (did you mean 'GATEWAY_API_KEY_FILE'?)" in message
    assert "'GATEWAY_ZZZZZZZZ'" in message and "'GATEWAY_ZZZZZZZZ' (did" not in message


def test_other_prefixes_and_lowercase_are_left_alone() -> None:
    # The repository's own tooling uses ROLLOUT_TESTBED_* and SIDECAR_* for this reason.
    env = {"ROLLOUT_GATEWAY_CACHE": "/c", "gateway_prot": "1", "MY_GATEWAY_X": "1",
           "ROLLOUT_TESTBED_VLLM_PYTHON": "/x", "SIDECAR_INSTALL": "x"}  # fmt: skip
    assert load_settings({}, environ=env).port == 8000


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("max_stalness: 2\n", "'max_stalness' (did you mean 'max_staleness'?)"),
        ("max-stalness: 2\n", "'max_stalness' (did you mean 'max_staleness'?)"),
        ("api_key_flie: /x\n", "'api_key_flie' (did you mean 'api_key_file'?)"),
        ("config: other.yaml\n", "'config'"),
    ],
)
def test_unknown_yaml_key_names_the_closest(tmp_path: Path, yaml_text: str, expected: str) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(ValueError) as info:
        load_settings({}, config_file=cfg, environ={})
    assert expected in str(info.value) and str(cfg) in str(info.value)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"config": "routing: {blok_size: 32}\n"}, "'blok_size' (did you mean 'block_size'?)"),
        ({"env": {"GATEWAY_ROUTING": '{"load_epsilom": 0.2}'}}, "did you mean 'load_epsilon'"),
        ({"config": "replicas: [{url: 'http://a:1', tokn: x}]\n"}, "did you mean 'token'"),
        (
            {"config": "runs: [{name: a, key: k, adapter_roots: /x}]\n"},
            "did you mean 'adapter_root'",
        ),
    ],
)
def test_unknown_nested_keys_name_the_closest(
    tmp_path: Path, source: dict[str, Any], expected: str
) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(source.get("config", ""))
    with pytest.raises(ValidationError) as info:
        load_settings({}, config_file=cfg, environ=source.get("env", {}))
    assert expected in str(info.value)


def test_known_routing_keys_pass() -> None:
    s = load_settings({}, environ={"GATEWAY_ROUTING": '{"block_size": 32, "load_epsilon": 0.2}'})
    assert s.routing == {"block_size": 32, "load_epsilon": 0.2}


def test_router_takes_only_the_policies_that_exist() -> None:
    assert set(get_args(Settings.model_fields["router"].annotation)) == set(ROUTERS)
    with pytest.raises(ValidationError) as info:
        load_settings({}, environ={"GATEWAY_ROUTER": "prefx"})
    assert "router" in str(info.value)
    assert load_settings({}, environ={"GATEWAY_ROUTER": "round_robin"}).router == "round_robin"


# --- one precedence for secrets, values and files alike -----------------------------------

LAYERS = ("flag", "env", "file")


def _layered(tmp_path: Path, given: dict[str, tuple[str, str]]) -> Settings:
    """``given``: layer -> (form, secret); form "value" or "file"."""
    flags: dict[str, Any] = {}
    env: dict[str, str] = {}
    yaml_lines = []
    for layer, (form, secret) in given.items():
        if form == "file":
            path = tmp_path / f"{layer}.key"
            path.write_text(secret + "\n")
            key, value = "api_key_file", str(path)
        else:
            key, value = "api_key", secret
        if layer == "flag":
            flags[key] = value
        elif layer == "env":
            env[f"GATEWAY_{key.upper()}"] = value
        else:
            yaml_lines.append(f"{key}: {value!r}")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("\n".join(yaml_lines) + "\n")
    return load_settings(flags, config_file=cfg, environ=env)


@pytest.mark.parametrize("high", LAYERS[:2])
@pytest.mark.parametrize("high_form", ["value", "file"])
@pytest.mark.parametrize("low_form", ["value", "file"])
def test_the_higher_layer_wins_whatever_the_forms(
    tmp_path: Path, high: str, high_form: str, low_form: str
) -> None:
    for low in LAYERS[LAYERS.index(high) + 1 :]:
        s = _layered(tmp_path, {high: (high_form, f"from-{high}"), low: (low_form, f"from-{low}")})
        assert s.api_key is not None and s.api_key.get_secret_value() == f"from-{high}", (
            high, high_form, low, low_form,
        )  # fmt: skip


def test_inline_yaml_key_does_not_beat_the_env_key_file(tmp_path: Path) -> None:
    """The issue's case: an inline ``api_key`` in YAML used to win over GATEWAY_API_KEY_FILE."""
    s = _layered(tmp_path, {"env": ("file", "from-env-file"), "file": ("value", "inline")})
    assert s.api_key is not None and s.api_key.get_secret_value() == "from-env-file"


def test_a_shadowed_secret_file_is_never_read(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"api_key_file: {tmp_path / 'missing'}\nadmin_key_file: /nonexistent\n")
    s = load_settings(
        {"admin_key": "flag-admin"}, config_file=cfg, environ={"GATEWAY_API_KEY": "env-key"}
    )
    assert s.api_key is not None and s.api_key.get_secret_value() == "env-key"
    assert s.admin_key is not None and s.admin_key.get_secret_value() == "flag-admin"


def test_both_forms_in_one_layer_is_an_error(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k")
    with pytest.raises(ValueError, match="api_key and api_key_file are both set by the env"):
        load_settings({}, environ={"GATEWAY_API_KEY": "k", "GATEWAY_API_KEY_FILE": str(key)})


def test_a_missing_winning_secret_file_fails_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_settings({}, environ={"GATEWAY_UPSTREAM_TOKEN_FILE": str(tmp_path / "nope")})
    assert f"GATEWAY_UPSTREAM_TOKEN_FILE ({tmp_path / 'nope'}): no such file" in str(info.value)


def test_an_empty_secret_is_refused_even_when_shadowed(tmp_path: Path) -> None:
    """A blank key below the winning layer is a mistake too (the unit rule; every source
    through the real CLI: tests/test_start_errors.py)."""
    with pytest.raises(ValueError, match="GATEWAY_ADMIN_KEY is empty"):
        load_settings({"admin_key": "flag-key"}, environ={"GATEWAY_ADMIN_KEY": " "})


@pytest.mark.parametrize("field", ["api_key", "admin_key", "upstream_token"])
def test_settings_built_directly_refuse_an_empty_secret(field: str) -> None:
    """Not only ``load_settings``: however ``Settings`` is built, an empty key is no key
    of "no auth"."""
    with pytest.raises(ValidationError, match=f"{field} is empty"):
        Settings(replicas=["http://r:1"], **{field: ""})


def test_a_non_string_secret_in_yaml_is_an_error_even_when_shadowed(tmp_path: Path) -> None:
    """``api_key: 8675309`` is a YAML number, a mistake whichever layer wins; the error
    names the setting, never the value."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("api_key: 8675309\n")
    with pytest.raises(ValueError) as info:
        load_settings({"api_key": "flag-key"}, config_file=cfg, environ={})
    assert f"api_key given by the config file {cfg} must be a string" in str(info.value)
    assert "8675309" not in str(info.value)


def _runs_file(tmp_path: Path, runs: str, extra: str = "") -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(f"replicas: [http://r0:8000]\nlora_slots_per_replica: 6\n{extra}runs:\n{runs}")
    return path


RUN_A = "  - {name: run-a, key: secret-a, adapter_root: /a}\n"
RUN_B = "  - {name: run-b, key: secret-b, adapter_root: /b, max_in_flight: 4}\n"


def test_a_reload_rereads_the_runs_and_names_other_changed_settings(tmp_path: Path) -> None:
    from gateway.config import reread_runs

    path = _runs_file(tmp_path, RUN_A)
    settings = load_settings(config_file=path, environ={})
    assert [r.name for r in reread_runs(settings).runs] == ["run-a"]
    _runs_file(tmp_path, RUN_A + RUN_B, extra="router: random\n")
    found = reread_runs(settings)
    assert [r.name for r in found.runs] == ["run-a", "run-b"] and found.runs[1].max_in_flight == 4
    assert found.lora_slots_per_replica == 6 and found.ignored == ("router",)


def test_a_restarted_owner_takes_the_files_runs_as_they_are_now(tmp_path: Path) -> None:
    from gateway.config import current_runs

    path = _runs_file(tmp_path, RUN_A)
    settings = load_settings(config_file=path, environ={})
    _runs_file(tmp_path, RUN_A + RUN_B)
    now = current_runs(settings)
    assert [r.name for r in now.runs] == ["run-a", "run-b"] and now.lora_slots_per_replica == 6
    assert [r.name for r in current_runs(now).runs] == ["run-a", "run-b"]  # still from the file
    _runs_file(tmp_path, "  []\n")  # unusable: the runs it was given
    assert [r.name for r in current_runs(settings).runs] == ["run-a"]
    flags = load_settings({"replicas": ["http://r0:8000"]}, environ={})
    assert current_runs(flags) is flags  # not from a file: nothing to re-read


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        (RUN_A + RUN_A.replace("secret-a", "other"), "run names must be unique"),
        (RUN_A + RUN_B.replace("secret-b", "secret-a"), "its own key"),
        ("  - {name: Bad_Name, key: secret-x, adapter_root: /x}\n", "runs[0].name"),
        ("  - {name: run-x, key: [secret-x], adapter_root: /x}\n", "runs[0].key"),
        (
            "  - {name: run-x, key: secret-x, adapter_root: /x, max_staleness: -1}\n",
            "max_staleness",
        ),
        ("  - {name: run-x, key: secret-x, adapter_root: /x, weight: 0}\n", "runs[0].weight"),
        ("  - {name: run-x, key: secret-x, adapter_root: /x, weight: fast}\n", "runs[0].weight"),
        ("  - {name: run-x, key: 'secret-x\n", "not valid YAML"),
        ("  []\n", "runs: is empty"),
    ],
)
def test_an_invalid_run_set_is_refused_naming_the_problem_never_a_key(
    tmp_path: Path, runs: str, expected: str
) -> None:
    from gateway.config import reread_runs

    settings = load_settings(config_file=_runs_file(tmp_path, RUN_A), environ={})
    _runs_file(tmp_path, runs)
    with pytest.raises(ValueError) as caught:
        reread_runs(settings)
    assert expected in str(caught.value) and "secret" not in str(caught.value)


def test_the_stamp_changes_with_the_files_content(tmp_path: Path) -> None:
    import os

    from gateway.config import config_stamp

    path = _runs_file(tmp_path, RUN_A)
    settings = load_settings(config_file=path, environ={})
    first, stat = config_stamp(settings), path.stat()
    _runs_file(tmp_path, RUN_A.replace("secret-a", "secret-z"))  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same time
    assert config_stamp(settings) not in (first, None)
    assert config_stamp(load_settings(environ={})) is None


def test_runs_from_flags_or_env_cannot_be_reloaded(tmp_path: Path) -> None:
    from gateway.config import reread_runs

    path = _runs_file(tmp_path, RUN_A)
    flagged = load_settings({"runs": [{"name": "run-z", "key": "kz", "adapter_root": "/z"}]},
                            config_file=path, environ={})  # fmt: skip
    with pytest.raises(ValueError, match="flag or the environment"):
        reread_runs(flagged)
    with pytest.raises(ValueError, match="config file"):
        reread_runs(load_settings({"runs": [{"name": "z", "key": "k", "adapter_root": "/"}]},
                                  environ={}))  # fmt: skip
