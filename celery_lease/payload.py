"""Typed payloads and results: validate and serialize at submit, rebuild in the worker.

A handler may annotate its payload and return type with a dataclass or a pydantic model;
``submit`` validates and serializes to plain JSON before anything is stored, so a bad
payload raises there and nothing is written. The rule: every JSON value celery-lease
stores (payload, result, progress, checkpoint) passes :func:`storable` (JSON, under its
cap, at most MAX_JSON_DEPTH deep, no NUL character or lone UTF-16 surrogate, which
PostgreSQL cannot store) or is *refused*, never silently altered. Stored error messages
are text for people: NUL and lone surrogates are *replaced* with U+FFFD before the
message is capped (:func:`cap_error`). Refusals raise :class:`UnstorableValue`, whose
message never quotes the value (it may carry a secret).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import re
import typing
from collections.abc import Callable
from typing import Any

from celery_lease.errors import CheckpointTooLarge, InvalidPayload

#: Default cap on a serialized payload (bytes). Payloads are wakeup-sized references
#: to work, not the work itself: put bulk data in your own tables or object store.
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
#: Default cap on a serialized checkpoint (bytes), checked on save and on load.
DEFAULT_MAX_CHECKPOINT_BYTES = 10 * 1024 * 1024
#: Default cap on a serialized result (bytes).
DEFAULT_MAX_RESULT_BYTES = 1024 * 1024
#: Default cap on one ctx.publish() value (bytes): lists of jobs carry every progress.
DEFAULT_MAX_PROGRESS_BYTES = 64 * 1024
#: Stored error messages are capped to this many bytes, cut on a UTF-8 boundary.
MAX_ERROR_BYTES = 512

#: The deepest a stored value may nest lists and objects (``[1]`` is 1, ``{"a": [1]}``
#: 2). Every reader has a limit of its own (the API's JSON serializer stops at 255
#: levels, Python's json near 1000), and a stored value past one is unreadable there
#: for good; far below both, and above any record or tree a job would pass around.
MAX_JSON_DEPTH = 100

#: A JSON string (keys included), so that brackets inside strings are not counted.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")

#: A JSON escape of NUL that is not itself an escaped backslash followed by "u0000".
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_UNTEXT = re.compile("[\x00\ud800-\udfff]")


class UnstorableValue(InvalidPayload):
    """A value cannot be stored in the job table (not JSON, over its cap, nested deeper
    than MAX_JSON_DEPTH, or holding a NUL or a lone surrogate). Its message names the
    value and the reason, never the value itself. Raised by submit (nothing is stored),
    by ``ctx.publish`` and ``ctx.save_checkpoint`` (nothing is written); a handler that
    lets it escape, or returns such a result, ends ``failed`` with this message,
    without retry."""


def _is_pydantic(tp: Any) -> bool:
    return inspect.isclass(tp) and hasattr(tp, "model_validate") and hasattr(tp, "model_dump")


def _is_dataclass_type(tp: Any) -> bool:
    return inspect.isclass(tp) and dataclasses.is_dataclass(tp)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def depth_over_limit(text: str) -> int | None:
    """How deep JSON ``text`` nests lists and objects when that is over MAX_JSON_DEPTH,
    else None; in linear time and without recursion, whatever the depth."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # the common case: cannot be deeper
        return None
    # Outside strings only. Without an escaped quote, every quote delimits a string:
    # the even pieces between quotes are the text outside them (much faster than the
    # regular expression, which is exact).
    outside = "".join(text.split('"')[::2]) if '\\"' not in text else _JSON_STRING.sub("", text)
    brackets = _NOT_BRACKET.sub("", outside)
    depth = max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    return depth if depth > MAX_JSON_DEPTH else None


def too_deep(value: Any) -> bool:
    """Whether a stored value nests deeper than MAX_JSON_DEPTH: one stored before the
    cap was checked, which readers show as omitted rather than fail on."""
    try:
        text = _dumps(value)
    except RecursionError:
        return True
    except (TypeError, ValueError):
        return False
    return depth_over_limit(text) is not None


def storable(value: Any, what: str, cap: int, setting: str) -> int:
    """Check that ``value`` can be stored as JSON; return its size in bytes.

    Raises UnstorableValue naming ``what`` and the reason, never quoting the value. A
    value is refused, never altered: changing one character of a result could corrupt a
    checksum or an identifier downstream.
    """
    try:
        # ensure_ascii=False keeps lone surrogates as characters, so encoding finds them;
        # NUL is escaped by json itself (as every control character is).
        text = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except RecursionError:
        raise UnstorableValue(f"{what} nests lists and objects deeper than the limit of {MAX_JSON_DEPTH} levels") from None
    except (TypeError, ValueError) as exc:
        # json's own text names types and reasons, never the values themselves.
        raise UnstorableValue(f"{what} is not JSON-serializable: {str(exc)[:200]}") from None
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        raise UnstorableValue(f"{what} contains a NUL character (U+0000), which PostgreSQL cannot store")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise UnstorableValue(f"{what} contains a lone surrogate (not valid Unicode text)") from None
    if size > cap:
        raise UnstorableValue(f"{what} is {size} bytes, over the cap of {cap} ({setting})")
    depth = depth_over_limit(text)
    if depth is not None:
        raise UnstorableValue(f"{what} nests lists and objects {depth} levels deep, over the limit of {MAX_JSON_DEPTH}")
    return size


def storable_text(value: Any, what: str, max_chars: int) -> str:
    """A short text column's value (idempotency key, tenant, queue): a str of at most
    ``max_chars`` characters without NUL or lone surrogates. Never quoted back."""
    if not isinstance(value, str):
        raise InvalidPayload(f"{what} must be a string, not {type(value).__name__}")
    if len(value) > max_chars:
        raise InvalidPayload(f"{what} is {len(value)} characters, over the limit of {max_chars}")
    if _UNTEXT.search(value):
        raise InvalidPayload(f"{what} contains a NUL character or a lone surrogate")
    return value


def _validation_text(exc: Exception) -> str:
    """What was wrong with the caller's input, without quoting the input: pydantic's
    own text includes the offending values (``input_value=...``)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            items = errors(include_input=False, include_url=False)
        except TypeError:
            items = None
        if items is not None:
            return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'payload'}: {e.get('msg')}" for e in items)[:500]
    return str(exc)[:500]


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
        except InvalidPayload:
            raise
        except (TypeError, ValueError) as exc:
            # Describe what is wrong with the caller's input without quoting it.
            raise InvalidPayload(f"payload refused: {_validation_text(exc)}") from None
        storable(value, "payload", max_bytes, "lease_max_payload_bytes")
        return json.loads(_dumps(value)) if value is not payload else value

    def load_payload(self, stored: Any) -> Any:
        tp: Any = self.payload_type
        if _is_pydantic(tp):
            return tp.model_validate(stored)
        if _is_dataclass_type(tp):
            return tp(**stored)
        return stored

    def dump_result(self, result: Any, max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> Any:
        """The result as JSON; raises UnstorableValue (the job fails, without retry)."""
        if result is None:
            return None  # the common case of a handler that returns nothing
        if _is_pydantic(type(result)):
            result = result.model_dump(mode="json")
        elif dataclasses.is_dataclass(result) and not isinstance(result, type):
            result = dataclasses.asdict(result)
        storable(result, "result", max_bytes, "lease_max_result_bytes")
        return result


def dump_checkpoint(data: Any, cap: int) -> Any:
    """Check a checkpoint before it is saved: UnstorableValue when it is not storable
    JSON, CheckpointTooLarge when it is over ``cap``."""
    size = storable(data, "checkpoint", 2**62, "lease_max_checkpoint_bytes")
    if size > cap:
        raise CheckpointTooLarge(f"checkpoint is {size} bytes, over the cap of {cap}")
    return data


def dump_progress(data: Any, cap: int) -> Any:
    storable(data, "progress", cap, "lease_max_progress_bytes")
    return data


def check_loaded_checkpoint(data: Any, cap: int) -> Any:
    if data is not None and len(_dumps(data).encode()) > cap:
        raise CheckpointTooLarge(f"stored checkpoint is over the cap of {cap} bytes")
    return data


def clean_text(message: str) -> str:
    """``message`` with NUL and lone surrogates replaced by U+FFFD: storable text."""
    return _UNTEXT.sub("\ufffd", message)


def cap_error(message: Any, limit: int = MAX_ERROR_BYTES) -> str:
    """A storable error message: NUL and lone surrogates replaced, then capped to
    ``limit`` bytes without splitting a UTF-8 character."""
    text = clean_text(str(message))
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", errors="ignore")
