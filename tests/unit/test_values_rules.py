"""The package's values at the boundary, without services (payload.py, job.py,
settings.py): what the job table can store and the caps on it, job ids, and how
settings are resolved."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_lease.errors import InvalidPayload
from celery_lease.job import parse_job_id
from celery_lease.payload import (
    MAX_JSON_DEPTH,
    Codec,
    UnstorableValue,
    cap_error,
    dump_checkpoint,
    dump_progress,
    storable,
    storable_text,
    too_deep,
)
from celery_lease.settings import Settings

# --- what the job table can store --------------------------------------------------------


@pytest.mark.parametrize(
    "value, says",
    [
        ({"x": "a\x00b"}, "contains a NUL character"),
        ({"a\x00": 1}, "contains a NUL character"),
        (["ok", ["deep", {"k": "\x00"}]], "contains a NUL character"),
        ({"x": "\\\\\x00"}, "contains a NUL character"),  # escaped backslashes, then NUL
        ({"x": "lone \ud800"}, "contains a lone surrogate"),
        ({"\udfff": 1}, "contains a lone surrogate"),
        ({"x": "\ud83d\ude00"}, "contains a lone surrogate"),  # a pair spelt as two code points
        ({"x": object()}, "is not JSON-serializable"),
        ({"x": float("nan")}, "is not JSON-serializable"),
        ({"x": "y" * 100}, "is 108 bytes, over the cap of 50 (lease_max_result_bytes)"),
    ],
)
def test_values_the_table_cannot_store_are_refused_without_quoting_them(value, says):
    with pytest.raises(UnstorableValue) as caught:
        storable(value, "result", 50, "lease_max_result_bytes")
    assert says in str(caught.value)
    assert "\x00" not in str(caught.value) and "yyyy" not in str(caught.value)


def test_storable_values_are_measured_in_utf8_bytes():
    # The six characters backslash-u-0-0-0-0 are text, not NUL; emoji are four bytes.
    assert storable({"x": "\\u0000"}, "payload", 100, "s") == len('{"x":"\\\\u0000"}')
    assert storable({"x": "😀"}, "payload", 100, "s") == len('{"x":""}') + 4


def test_results_are_capped_and_typed_results_checked_too():
    codec = Codec(lambda ctx, payload: payload)
    assert codec.dump_result({"rows": 3}, max_bytes=100) == {"rows": 3}
    with pytest.raises(UnstorableValue, match="over the cap of 10"):
        codec.dump_result({"rows": "x" * 20}, max_bytes=10)
    with pytest.raises(UnstorableValue, match="not JSON-serializable"):
        codec.dump_result({1, 2})


def test_checkpoints_refuse_nul_and_keep_their_size_error():
    with pytest.raises(UnstorableValue, match="checkpoint contains a NUL"):
        dump_checkpoint({"i": "\x00"}, 100)
    with pytest.raises(InvalidPayload):  # UnstorableValue is an InvalidPayload, as before
        dump_checkpoint({"x": object()}, 100)


def _nested(depth: int) -> object:
    value: object = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_values_nested_deeper_than_the_limit_are_refused_wherever_they_enter():
    """Before: a value 400 levels deep was stored, and every reader whose serializer
    stops sooner (the API's, at 255) failed on its row for good."""
    codec = Codec(lambda ctx, payload: payload)
    assert codec.dump_payload(_nested(MAX_JSON_DEPTH)) == _nested(MAX_JSON_DEPTH)  # at the limit: fine
    for depth in (MAX_JSON_DEPTH + 1, 400, 5000):  # 5000: past Python's own recursion limit
        says = (
            f"levels deep, over the limit of {MAX_JSON_DEPTH}" if depth < 1000 else f"deeper than the limit of {MAX_JSON_DEPTH}"
        )
        for refuse in (
            lambda v: codec.dump_payload(v),
            lambda v: codec.dump_result(v),
            lambda v: dump_progress(v, 10**6),
            lambda v: dump_checkpoint(v, 10**6),
        ):
            with pytest.raises(UnstorableValue, match=says):
                refuse(_nested(depth))
    with pytest.raises(UnstorableValue, match="^payload nests lists and objects 401 levels deep, over the limit of 100$"):
        codec.dump_payload(_nested(401))
    # Brackets in strings and keys are text, not nesting; nor are escaped quotes.
    assert storable({"[" * 300: "{" * 300, "q": '\\"[[[' * 100}, "result", 10**6, "s") > 0
    assert too_deep(_nested(MAX_JSON_DEPTH + 1)) and not too_deep(_nested(MAX_JSON_DEPTH)) and not too_deep(None)


def test_cap_error_survives_nul_and_lone_surrogates():
    """Before, cap_error raised UnicodeEncodeError on a lone surrogate (the job then sat
    running until its lease expired), and NUL went on to fail the UPDATE."""
    assert cap_error("a\x00b \ud800 c") == "a\ufffdb \ufffd c"
    capped = cap_error("\ud800" * 400)
    assert capped == "\ufffd" * 170 and len(capped.encode()) <= 512
    assert cap_error(ValueError("not a str")) == "not a str"


def test_short_text_columns():
    assert storable_text("acme", "tenant", 200) == "acme"
    for value, says in (
        (7, "must be a string, not int"),
        ("x" * 201, "201 characters"),
        ("a\x00", "NUL"),
        ("\udc00", "surrogate"),
    ):
        with pytest.raises(InvalidPayload, match=says):
            storable_text(value, "tenant", 200)


def test_result_and_progress_caps_are_settings():
    s = Settings.resolve({"lease_max_result_bytes": "2048"}, {"max_progress_bytes": 512})
    assert (s.max_result_bytes, s.max_progress_bytes) == (2048, 512)
    assert Settings().max_progress_bytes == 64 * 1024 and Settings().max_result_bytes == 1024 * 1024


def test_settings_precedence_and_typos():
    conf = {"lease_batch_size": "50", "lease_reap_interval": 2}
    s = Settings.resolve(conf, {"reap_interval": 7.5})
    assert (s.batch_size, s.reap_interval, s.sweep_interval) == (50, 7.5, Settings().sweep_interval)
    with pytest.raises(TypeError, match="unknown setting 'batch'"):
        Settings.resolve({}, {"batch": 1})


def test_settings_are_read_after_a_later_config_from_object():
    from celery_lease import CeleryLease

    app = Celery("late", broker="memory://")
    leases = CeleryLease(app, "sqlite://")

    class Config:
        lease_sweep_stale_seconds = 3.0

    app.config_from_object(Config)
    assert leases.settings.sweep_stale_seconds == 3.0


def test_a_misspelt_lease_setting_is_warned_about_with_the_nearest_real_one(caplog):
    import sys
    import types

    from celery_lease import CeleryLease
    from celery_lease.ops import tokens
    from celery_lease.settings import OTHER_SETTINGS

    # Every lease_* key read outside Settings is known, so never warned about.
    assert {f"lease_{n}" for n in OTHER_SETTINGS} == {
        tokens.TOKENS_SETTING,
        tokens.METRICS_TOKEN_SETTING,
        tokens.SECRET_SETTING,
        "lease_database_url",
    }
    app = Celery("typo", broker="memory://")
    app.conf.update(lease_cookie_secure=True, lease_reap_intervall=3, lease_batch_size=10, lease_api_tokens={}, lease_zz=1)
    leases = CeleryLease(app, "sqlite://")
    with caplog.at_level("WARNING", logger="celery_lease"):
        assert leases.settings.dashboard_secure_cookie is False and leases.settings.batch_size == 10
        assert leases.settings.batch_size == 10  # read again: warned once
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sorted(warned) == [
        "celery-lease: unknown setting 'lease_cookie_secure' is ignored; did you mean 'lease_dashboard_secure_cookie'?",
        "celery-lease: unknown setting 'lease_reap_intervall' is ignored; did you mean 'lease_reap_interval'?",
        "celery-lease: unknown setting 'lease_zz' is ignored",
    ]

    # Django's CELERY namespace keeps the key as written, and so does the suggestion.
    module = types.ModuleType("typo_settings")
    module.CELERY_LEASE_SECURE_COOKIE = True  # type: ignore[attr-defined]
    module.CELERY_LEASE_BATCH_SIZE = 20  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        django_app = Celery("typo_django", broker="memory://")
        django_app.config_from_object(module.__name__, namespace="CELERY")
        caplog.clear()
        with caplog.at_level("WARNING", logger="celery_lease"):
            assert CeleryLease(django_app, "sqlite://").settings.batch_size == 20
    finally:
        del sys.modules[module.__name__]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "celery-lease: unknown setting 'CELERY_LEASE_SECURE_COOKIE' is ignored; "
        "did you mean 'CELERY_LEASE_DASHBOARD_SECURE_COOKIE'?"
    ]


def test_job_ids_are_checked_at_the_boundary():
    assert parse_job_id("6F1C2C9E-0B0E-4A53-9D6A-3B1F7D2B8C11") == "6f1c2c9e-0b0e-4a53-9d6a-3b1f7d2b8c11"
    with pytest.raises(ValueError, match="not a job id"):
        parse_job_id("x" * 500)
