"""Payload, result and checkpoint codecs; error capping."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest

from celery_lease.errors import CheckpointTooLarge, InvalidPayload
from celery_lease.payload import Codec, cap_error, check_loaded_checkpoint, dump_checkpoint


@dataclasses.dataclass
class Order:
    id: int
    sku: str


class Model(pydantic.BaseModel):
    table: str
    limit: int = 10


def plain(ctx, payload):
    return payload


def typed(ctx, payload: Order) -> Order:
    return payload


def modelled(ctx, payload: Model) -> Model:
    return payload


def test_plain_payload_round_trips_as_json():
    codec = Codec(plain)
    assert codec.dump_payload({"a": [1, 2]}) == {"a": [1, 2]}
    assert codec.load_payload({"a": 1}) == {"a": 1}


@pytest.mark.parametrize("bad", [None, {"x": object()}, {"nan": float("nan")}])
def test_payloads_that_are_not_json_are_refused(bad):
    with pytest.raises(InvalidPayload):
        Codec(plain).dump_payload(bad)


def test_payload_cap():
    with pytest.raises(InvalidPayload, match="over the cap of 10"):
        Codec(plain).dump_payload({"blob": "x" * 20}, max_bytes=10)


def test_dataclass_payload_is_validated_and_rebuilt():
    codec = Codec(typed)
    assert codec.dump_payload(Order(1, "a")) == {"id": 1, "sku": "a"}
    assert codec.dump_payload({"id": 2, "sku": "b"}) == {"id": 2, "sku": "b"}
    assert codec.load_payload({"id": 3, "sku": "c"}) == Order(3, "c")
    with pytest.raises(InvalidPayload):
        codec.dump_payload({"id": 1})  # missing field
    assert codec.dump_result(Order(4, "d")) == {"id": 4, "sku": "d"}


def test_pydantic_payload_is_validated_and_rebuilt():
    codec = Codec(modelled)
    assert codec.dump_payload({"table": "users"}) == {"table": "users", "limit": 10}
    assert codec.load_payload({"table": "t", "limit": 2}) == Model(table="t", limit=2)
    with pytest.raises(InvalidPayload, match="payload refused"):
        codec.dump_payload({"limit": "many"})
    assert codec.dump_result(Model(table="x")) == {"table": "x", "limit": 10}


def test_a_handler_must_take_ctx_and_payload():
    with pytest.raises(TypeError, match="must take \\(ctx, payload\\)"):
        Codec(lambda payload: payload)


def test_checkpoint_caps_on_save_and_on_load():
    assert dump_checkpoint({"i": 1}, 100) == {"i": 1}
    with pytest.raises(CheckpointTooLarge):
        dump_checkpoint({"blob": "x" * 200}, 100)
    with pytest.raises(InvalidPayload):
        dump_checkpoint({"x": object()}, 100)
    assert check_loaded_checkpoint(None, 1) is None
    with pytest.raises(CheckpointTooLarge):
        check_loaded_checkpoint({"blob": "x" * 200}, 100)


def test_cap_error_cuts_on_a_utf8_boundary():
    assert cap_error("short") == "short"
    capped = cap_error("é" * 400)  # 800 bytes
    assert len(capped.encode()) <= 512 and capped == "é" * 256
    capped = cap_error("a" + "€" * 300, limit=8)  # 1 + 3 + 3 bytes fit, the next would not
    assert capped == "a€€"
