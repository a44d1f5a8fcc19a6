"""The key checks fail closed, and say what they enforce (``Credentials.summary``: the
start line's ``auth ...`` and ``/gateway/status``'s ``auth`` read it). Through the real
CLI: tests/test_cli.py and tests/test_start_errors.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from gateway.app import build_gateway
from gateway.config import Settings, load_settings


def _summary(**given: object) -> dict[str, str]:
    settings = load_settings({"replicas": ["http://127.0.0.1:9"], **given}, environ={})
    return build_gateway(settings).credentials.summary()


@pytest.mark.parametrize("field", ["api_key", "admin_key"])
def test_an_empty_key_that_slipped_past_config_is_refused_not_open(field: str) -> None:
    """``Settings.model_construct`` skips validation, as a future code path might: the
    checks must still never read an empty key as "no key" (no auth, or the client key
    acting as admin)."""
    keys = {"api_key": SecretStr("sk-client"), field: SecretStr(" ")}
    settings = Settings.model_construct(replicas=[], **keys)
    with pytest.raises(ValueError, match="empty key"):
        build_gateway(settings)


@pytest.mark.parametrize(
    ("given", "clients", "control"),
    [
        ({}, "none", "none"),
        ({"api_key": "sk-c"}, "api key", "api key"),
        ({"api_key": "sk-c", "admin_key": "sk-a"}, "api key", "admin key"),
        ({"admin_key": "sk-a"}, "none", "admin key"),
    ],
)
def test_the_summary_is_what_single_run_mode_checks(
    given: dict[str, str], clients: str, control: str
) -> None:
    assert _summary(**given) == {"clients": clients, "control": control}


def test_multi_run_mode_names_the_run_keys(tmp_path: Path) -> None:
    runs = [{"name": "run-a", "key": "sk-a", "adapter_root": str(tmp_path)}]
    assert _summary(runs=runs, admin_key="sk-admin") == {
        "clients": "run keys",
        "control": "run keys",
    }
