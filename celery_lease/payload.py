"""Typed payloads and results: validate and serialize at submit, rebuild in the worker.

A handler may annotate its payload and return type with a dataclass or a pydantic
model. ``submit`` validates and serializes to plain JSON before anything is stored, so
a bad payload raises there and nothing is written.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from celery_lease.errors import CheckpointTooLarge, InvalidPayload

#: Default cap on a serialized payload (bytes). Payloads are wakeup-sized references
#: to work, not the work itself: put bulk data in your own tables or object store.
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
#: Default cap on a serialized checkpoint (bytes), checked on save and on load.
DEFAULT_MAX_CHECKPOINT_BYTES = 10 * 1024 * 1024
#: Stored error messages are capped to this many bytes, cut on a UTF-8 boundary.
MAX_ERROR_BYTES = 512


def _is_pydantic(tp: Any) -> bool:
    return inspect.isclass(tp) and hasattr(tp, "model_validate") and hasattr(tp, "model_dump")


def _is_dataclass_type(tp: Any) -> bool:
    return inspect.isclass(tp) and dataclasses.is_dataclass(tp)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class Codec:
    """Converts one handler's payload and result between Python and JSON."""

    def __init__(self, fn: Callable) -> None:
        params = list(inspect.signature(fn).parameters.values())
        if len(params) != 2:
            raise TypeError(f"job handler {fn.__qualname__} must take (ctx, payload), got {len(params)} parameters")
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # unresolvable forward references: treat as untyped
            hints = {}
        self.payload_type = hints.get(params[1].name)
        self.result_type = hints.get("return")

    def dump_payload(self, payload: Any, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Any:
        """Validate and serialize; raises InvalidPayload, having stored nothing."""
        tp: Any = self.payload_type
        if payload is None:
            raise InvalidPayload("payload is required: pass {} for a job that needs no input")
        try:
            if _is_pydantic(tp):
                model = payload if isinstance(payload, tp) else tp.model_validate(payload)
                value = model.model_dump(mode="json")
            elif _is_dataclass_type(tp):
                obj = payload if isinstance(payload, tp) else tp(**payload)
                value = dataclasses.asdict(obj)
            else:
                value = payload
            text = _dumps(value)
        except InvalidPayload:
            raise
        except (TypeError, ValueError) as exc:
            # pydantic's ValidationError is a ValueError; its text describes the
            # caller's own input, so it is safe and useful to show.
            raise InvalidPayload(f"payload refused: {exc}") from None
        if len(text.encode()) > max_bytes:
            raise InvalidPayload(f"payload is {len(text.encode())} bytes, over the cap of {max_bytes}")
        return json.loads(text) if value is not payload else value

    def load_payload(self, stored: Any) -> Any:
        tp: Any = self.payload_type
        if _is_pydantic(tp):
            return tp.model_validate(stored)
        if _is_dataclass_type(tp):
            return tp(**stored)
        return stored

    def dump_result(self, result: Any) -> Any:
        if _is_pydantic(type(result)):
            return result.model_dump(mode="json")
        if dataclasses.is_dataclass(result) and not isinstance(result, type):
            result = dataclasses.asdict(result)
        _dumps(result)  # raises TypeError/ValueError on a result that is not JSON
        return result


def dump_checkpoint(data: Any, cap: int) -> Any:
    try:
        size = len(_dumps(data).encode())
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"checkpoint is not JSON-serializable: {exc}") from None
    if size > cap:
        raise CheckpointTooLarge(f"checkpoint is {size} bytes, over the cap of {cap}")
    return data


def check_loaded_checkpoint(data: Any, cap: int) -> Any:
    if data is not None and len(_dumps(data).encode()) > cap:
        raise CheckpointTooLarge(f"stored checkpoint is over the cap of {cap} bytes")
    return data


def cap_error(message: str, limit: int = MAX_ERROR_BYTES) -> str:
    """Cap a message to ``limit`` bytes without splitting a UTF-8 character."""
    raw = message.encode("utf-8")
    if len(raw) <= limit:
        return message
    return raw[:limit].decode("utf-8", errors="ignore")
