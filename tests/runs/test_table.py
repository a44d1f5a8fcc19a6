"""``runs.table``: a run is its credential; its adapter names are its own."""

from __future__ import annotations

from base64 import b64encode
from pathlib import Path

import orjson
import pytest

from gateway.runs.table import Run, RunTable, owner_of, presented_credential

A = Run("run-a", b"key-a", 1)
B = Run("run-b", b"key-b", 2)
TABLE = RunTable([A, B])


def basic(user: str, key: str) -> bytes:
    return b"Basic " + b64encode(f"{user}:{key}".encode())


@pytest.mark.parametrize(
    ("authorization", "expected"),
    [
        (basic("run-a", "key-a"), A),  # what TRL sends for http://run-a:key-a@gateway
        (basic("", "key-b"), B),  # no user: the key alone names the run
        (b"Bearer key-b", B),
        (b"bearer key-a", A),
        (basic("run-b", "key-a"), None),  # a user that is not the key's run
        (basic("run-a", "key-b"), None),
        (b"Bearer key-c", None),
        (b"Bearer ", None),
        (b"Basic !!!", None),  # not base64
        (b"Basic " + b64encode(b"no-colon"), None),
        (b"Digest key-a", None),
        (None, None),
        (b"", None),
    ],
)
def test_identify(authorization: bytes | None, expected: Run | None) -> None:
    assert TABLE.identify(authorization) == expected


def test_presented_credential_splits_basic_at_the_first_colon() -> None:
    assert presented_credential(basic("run-a", "k:with:colons")) == (b"run-a", b"k:with:colons")


def test_names_are_scoped_per_run_and_their_owner_is_read_off_them() -> None:
    name = A.replica_name("trl-policy-v3")
    assert name == "run-a~trl-policy-v3" != B.replica_name("trl-policy-v3")
    assert owner_of(name) == "run-a"
    assert A.client_name(name) == "trl-policy-v3"
    assert B.client_name(name) is None
    assert owner_of("trl-policy-v3") is None  # a single-run leftover: nobody's
    assert owner_of("~x") is None and owner_of("run-a~") is None


def test_single_run_mode_is_one_run_without_a_prefix() -> None:
    single = Run("", None, 4)
    table = RunTable([single])
    assert not table.multi
    assert single.replica_name("trl-policy-v1") == "trl-policy-v1"
    assert single.client_name("trl-policy-v1") == "trl-policy-v1"
    assert single.unscope(b"`trl-policy-v1`") == b"`trl-policy-v1`"


def test_unscope_removes_the_prefix_from_control_bodies() -> None:
    text = b"Success: LoRA adapter 'run-a~trl-policy-v2' added successfully."
    assert A.unscope(text) == b"Success: LoRA adapter 'trl-policy-v2' added successfully."
    assert A.unscope_text("The model `run-a~x` does not exist.") == "The model `x` does not exist."


def test_slots_are_the_staleness_window_plus_one_to_sync() -> None:
    assert A.slots == 3 and B.slots == 4


def test_every_run_needs_a_name_and_a_key_in_multi_run_mode() -> None:
    with pytest.raises(ValueError, match="name and a key"):
        RunTable([A, Run("", None, 1)])


def test_a_run_crosses_the_owners_channel_whole() -> None:
    """What the owner sends its workers on a reload (JSON): every field comes back, the
    key's bytes exactly, whatever they are."""
    run = Run("run-x", b"k\x00\xff:=", 3, (Path("/a"), Path("/b")), 7, 2.5, 9.0, 0.25)
    wire = orjson.loads(orjson.dumps(run.to_wire()))
    assert Run.from_wire(wire) == run
    assert Run.from_wire(wire).prefix == "run-x~"
    single = Run("", None, 2)
    assert Run.from_wire(orjson.loads(orjson.dumps(single.to_wire()))) == single
