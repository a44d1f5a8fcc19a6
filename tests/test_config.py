from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import load_settings


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
