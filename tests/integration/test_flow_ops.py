"""Flow control as operators meet it: `celery -A ... lease pause|resume|limits` as real
subprocesses, the HTTP API and the metrics, against PostgreSQL. Jobs are put in the
states to show with make_job; no worker runs."""

from __future__ import annotations

import json
import subprocess

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs, limits, pauses
from celery_lease.errors import InvalidPayload
from tests.conftest import CELERY, ROOT, _env

MODULE = "tests.apps.app_flow"


@pytest.fixture
def cli(pg, broker):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [CELERY, "-A", MODULE, "lease", *args], env=_env(pg, broker), cwd=ROOT, capture_output=True, text=True, timeout=120
        )

    return run


def paused_kinds(db: str) -> set[str]:
    with sa.create_engine(db).connect() as conn:
        return {r[0] for r in conn.execute(sa.select(pauses.c.kind))}


def test_pause_and_resume_from_the_cli_are_stored_and_resume_wakes_the_held(cli, pg, make_job):
    proc = cli("pause", "unlimited")
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "paused unlimited", "")
    assert paused_kinds(pg) == {"unlimited"}
    assert cli("pause", "unlimited").stdout.strip() == "unlimited was already paused"
    held = make_job(pg, kind="unlimited", task="tests.apps.app_flow.unlimited", held="pause")
    proc = cli("resume", "unlimited", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"kind": "unlimited", "paused": False, "woken": 1}
    assert paused_kinds(pg) == set()
    with sa.create_engine(pg).connect() as conn:
        row = conn.execute(sa.select(jobs.c.held, jobs.c.woken_at).where(jobs.c.id == held)).one()
    assert row.held is None and row.woken_at is not None


def test_pause_of_an_unknown_kind_is_refused_in_one_line_and_stores_nothing(cli, pg):
    proc = cli("pause", "no-such-kind")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("celery-lease: no job handler for kind 'no-such-kind'") and len(proc.stderr.splitlines()) == 1
    assert paused_kinds(pg) == set()


def test_priority_is_checked_at_submit_and_celery_s_priority_option_carries_it(pg, broker, client_app):
    mod = client_app(pg, broker, module=MODULE)
    for bad in (-1, 1.5, "9", True, 256):
        with pytest.raises(TypeError, match="priority"):  # Celery's range, checked with the other options
            mod.unlimited.submit({}, priority=bad)
    with pytest.raises(InvalidPayload, match="priority"):  # a child's options reach the producer directly
        mod.leases.producer.job_row(mod.leases.registry.resolve("unlimited"), {}, {"priority": -1})
    with sa.create_engine(pg).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar() == 0  # nothing stored
    assert mod.unlimited.submit({}, priority=7).priority == 7
    assert mod.leases.get(mod.unlimited.apply_async(({},), priority=3).id).priority == 3
    assert mod.unlimited.submit({}).priority == 0


# --- what operators see ------------------------------------------------------------------


@pytest.fixture
def flow_scene(pg, make_job):
    """limited2: 2 running, 3 held by the limit, 1 queued; per_tenant: key a running,
    key b held; unlimited: paused, 1 held by the pause (tenant acme)."""
    task = "tests.apps.app_flow."
    for _ in range(2):
        make_job(pg, kind="limited2", task=task + "limited2", status="running", tenant="globex")
    for _ in range(3):
        make_job(pg, kind="limited2", task=task + "limited2", held="limit", tenant="globex")
    make_job(pg, kind="limited2", task=task + "limited2", tenant="globex")
    make_job(pg, kind="per_tenant", task=task + "per_tenant", status="running", concurrency_key="a", tenant="globex")
    make_job(pg, kind="per_tenant", task=task + "per_tenant", held="limit", concurrency_key="b", tenant="globex")
    make_job(pg, kind="unlimited", task=task + "unlimited", held="pause", tenant="acme")
    make_job(pg, kind="unlimited", task=task + "unlimited", status="succeeded", tenant="acme")  # not counted
    with sa.create_engine(pg).begin() as conn:
        conn.execute(pauses.insert().values(kind="unlimited", paused_at=sa.func.now()))


def by_kind_key(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["kind"], r["key"]): r for r in rows}


EXPECTED = {
    ("limited2", None): {"concurrency": 2, "running": 2, "waiting_limit": 3, "pending": 1, "paused": False},
    ("per_tenant", "a"): {"concurrency": 1, "running": 1, "waiting_limit": 0},
    ("per_tenant", "b"): {"concurrency": 1, "running": 0, "waiting_limit": 1},
    ("unlimited", None): {"concurrency": None, "paused": True, "waiting_pause": 1, "running": 0},
    ("rated", None): {"rate_limit": "4/s", "running": 0, "pending": 0},
}


def test_cli_limits_shows_per_kind_and_key_what_runs_and_what_waits_on_what(cli, flow_scene):
    proc = cli("limits", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = by_kind_key(json.loads(proc.stdout)["kinds"])
    for key, expected in EXPECTED.items():
        assert {k: rows[key][k] for k in expected} == expected, key
    text = cli("limits").stdout.splitlines()
    header = "KIND KEY CONCURRENCY RATE CONCURRENCY_FROM RATE_FROM PAUSED RUNNING WAIT_LIMIT WAIT_RATE WAIT_PAUSE PENDING"
    assert text[0].split() == header.split()
    assert any(line.split()[:1] == ["limited2"] and line.split()[-5:] == ["2", "3", "0", "0", "1"] for line in text)


def test_api_limits_counts_only_the_callers_tenant(pg, broker, client_app, flow_scene):
    from fastapi.testclient import TestClient

    from celery_lease.ops.api import create_app

    admin, acme_token = "admin-token-8b3c1e0f77", "acme-token-1f6d29ab40"
    tokens = {admin: None, acme_token: "acme"}
    mod = client_app(pg, broker, conf={"lease_api_tokens": tokens}, module=MODULE)
    client = TestClient(create_app(mod.leases))
    assert client.get("/api/v1/limits").status_code == 401
    everything = by_kind_key(client.get("/api/v1/limits", headers={"Authorization": f"Bearer {admin}"}).json()["kinds"])
    assert everything[("limited2", None)]["waiting_limit"] == 3 and everything[("unlimited", None)]["waiting_pause"] == 1
    acme = client.get("/api/v1/limits", headers={"Authorization": f"Bearer {acme_token}"}).json()["kinds"]
    assert [(r["kind"], r["waiting_pause"], r["paused"]) for r in acme] == [("unlimited", 1, True)]


def test_metrics_show_flow_control_per_kind_key_and_state(pg, broker, client_app, flow_scene):
    from prometheus_client.parser import text_string_to_metric_families

    from celery_lease.ops import metrics

    # Concurrency keys are payload text: exported only when the operator opts in.
    mod = client_app(pg, broker, module=MODULE, conf={"lease_metrics_key_labels": 10})
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(mod.leases).decode())}
    flow = {(s.labels["kind"], s.labels["key"], s.labels["state"]): s.value for s in families["celery_lease_flow_jobs"].samples}
    assert flow[("limited2", "", "running")] == 2 and flow[("limited2", "", "waiting_limit")] == 3
    assert flow[("per_tenant", "b", "waiting_limit")] == 1 and flow[("unlimited", "", "waiting_pause")] == 1
    assert {s.labels["kind"]: s.value for s in families["celery_lease_paused"].samples} == {"unlimited": 1}


# --- slots freed outside their worker ----------------------------------------------------


def _fill_one_slot(mod) -> tuple[str, str]:
    """one_slot (concurrency=1): one job claimed, one held by the limit."""
    spec = mod.leases.registry.resolve("one_slot")
    first, second = (j.id for j in mod.one_slot.submit_many([{}, {}]))
    assert mod.leases.flow.claim(first, spec, "w9@host/1/boot") is not None
    assert mod.leases.flow.claim(second, spec, "w9@host/1/boot") is None
    return first, second


def held(db: str, job_id: str):
    with sa.create_engine(db).connect() as conn:
        return conn.execute(sa.select(jobs.c.held).where(jobs.c.id == job_id)).scalar_one()


def test_a_cancel_wakes_the_job_held_by_the_slot_it_frees(pg, broker, client_app):
    mod = client_app(pg, broker, module=MODULE)
    first, second = _fill_one_slot(mod)
    assert held(pg, second) == "limit"
    assert mod.leases.cancel(first)
    assert held(pg, second) is None  # woken (its wakeup is in Redis) by the cancel itself


def test_a_reap_wakes_the_job_held_by_the_slot_it_frees(pg, broker, client_app):
    mod = client_app(pg, broker, module=MODULE)
    first, second = _fill_one_slot(mod)
    with sa.create_engine(pg).begin() as conn:
        expired = sa.func.now() - sa.text("interval '1 second'")
        conn.execute(sa.update(jobs).where(jobs.c.id == first).values(lease_expires_at=expired))
    assert mod.leases.reap() == {"requeued": 0, "expired": 1}  # max_attempts=1: expired, slot freed too
    assert held(pg, second) is None


# --- the limited claim on PostgreSQL, both transports ------------------------------------


@pytest.mark.parametrize("prepare", [True, False], ids=["one-round-trip-script", "transaction"])
def test_limited_claim_hold_and_release_on_postgresql(pg, make_job, prepare):
    from celery_lease.db.store import Store
    from celery_lease.flow.limits import Limits, Rate
    from celery_lease.flow.store import FlowStore

    store = Store(pg, prepare_statements=prepare)
    flow = FlowStore(store)
    try:
        limits = Limits(concurrency=2, rate=Rate(3, 3600))
        ids = [make_job(pg, kind="k", task="t") for _ in range(5)]
        first, second = (flow.claim_limited(i, "n/1/b", "k", "t", limits).row for i in ids[:2])
        assert first is not None and second is not None and first["window_claims"] == 1 and second["window_claims"] == 2
        assert flow.claim_limited(ids[2], "n/1/b", "k", "t", limits).held == "limit"
        with store.durable.begin() as conn:
            conn.execute(sa.update(jobs).where(jobs.c.id == ids[0]).values(status="succeeded"))
        assert [str(w["id"]) for w in flow.wake_for_slot("k", None)] == [ids[2]]
        assert flow.claim_limited(ids[2], "n/1/b", "k", "t", limits).row is not None  # the third claim of the window
        with store.durable.begin() as conn:
            conn.execute(sa.update(jobs).where(jobs.c.id == ids[1]).values(status="succeeded"))
        refused = flow.claim_limited(ids[3], "n/1/b", "k", "t", limits)  # a slot is free, the window is not
        assert refused.held == "rate" and refused.later is not None and 0 <= refused.later[0] <= 3600
        assert flow.claim_limited(ids[4], "n/1/b", "k", "t", limits).later is None  # one wakeup per window
    finally:
        store.dispose()


# --- runtime limits: an operator's override ------------------------------------------------


def stored_limits(db: str) -> dict[str, tuple]:
    with sa.create_engine(db).connect() as conn:
        cols = (limits.c.kind, limits.c.concurrency_override, limits.c.rate_override, limits.c.per_seconds_override)
        return {r[0]: tuple(r[1:]) for r in conn.execute(sa.select(*cols))}


@pytest.fixture
def api(pg, broker, client_app):
    """The API in this process (TestClient) on app_flow, with an admin, a tenant's and a
    read-only token: api(token) -> headers."""
    from fastapi.testclient import TestClient

    from celery_lease.ops.api import create_app

    # Tokens are at least 20 characters; the tests name them by role.
    named = {role: f"{role}-token-flow-0123456789" for role in ("admin", "acme", "reader")}
    grants = {"admin": None, "acme": "acme", "reader": {"tenant": None, "read_only": True}}
    tokens = {named[role]: grant for role, grant in grants.items()}
    mod = client_app(pg, broker, conf={"lease_api_tokens": tokens}, module=MODULE)
    client = TestClient(create_app(mod.leases))
    client.as_ = lambda role: {"Authorization": f"Bearer {named[role]}"}
    return client


def test_api_sets_and_clears_a_kinds_limits_and_the_listing_says_where_each_comes_from(api, pg):
    admin = api.as_("admin")
    r = api.put("/api/v1/kinds/limited2/limits", json={"concurrency": 1, "rate_limit": "5/m"}, headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "kind": "limited2",
        "concurrency": 1,
        "rate_limit": "5/m",
        "concurrency_source": "override",
        "rate_limit_source": "override",
        "declared_concurrency": 2,
        "declared_rate_limit": None,
    }
    assert stored_limits(pg)["limited2"] == (1, 5, 60)
    # null: explicitly no limit (not the code's 2); a field left out stays as it is.
    r = api.put("/api/v1/kinds/limited2/limits", json={"concurrency": None}, headers=admin)
    assert (r.json()["concurrency"], r.json()["concurrency_source"], r.json()["rate_limit"]) == (None, "override", "5/m")
    assert stored_limits(pg)["limited2"] == (0, 5, 60)
    r = api.put("/api/v1/kinds/limited2/limits", json={"concurrency": "default"}, headers=admin)
    assert (r.json()["concurrency"], r.json()["concurrency_source"]) == (2, "code")
    assert api.delete("/api/v1/kinds/limited2/limits", headers=admin).json()["rate_limit_source"] == "code"
    assert stored_limits(pg)["limited2"] == (None, None, None)
    # An idle kind, with no job and no limit in code, is listed and can be limited.
    listed = by_kind_key(api.get("/api/v1/limits", headers=admin).json()["kinds"])
    assert listed[("unlimited", None)]["running"] == 0 and listed[("unlimited", None)]["concurrency"] is None
    assert api.put("/api/v1/kinds/unlimited/limits", json={"concurrency": 3}, headers=admin).status_code == 200
    listed = by_kind_key(api.get("/api/v1/limits", headers=admin).json()["kinds"])
    assert (listed[("unlimited", None)]["concurrency"], listed[("unlimited", None)]["concurrency_source"]) == (3, "override")


@pytest.mark.parametrize(
    "token, body, status, error",
    [
        ("acme", {"concurrency": 1}, 403, "forbidden"),  # a tenant's token: the limit binds every tenant
        ("reader", {"concurrency": 1}, 403, "forbidden"),
        ("admin", {}, 400, "bad_request"),
        ("admin", {"concurrency": 0}, 400, "bad_request"),
        ("admin", {"concurrency": "1"}, 400, "bad_request"),
        ("admin", {"concurrency": True}, 400, "bad_request"),
        ("admin", {"concurrency": 1, "rate": "5/s"}, 400, "bad_request"),  # a misspelt field
        ("admin", {"rate_limit": "5 per second"}, 400, "bad_request"),
        ("admin", {"rate_limit": "0/s"}, 400, "bad_request"),
        ("admin", [1], 400, "bad_request"),
    ],
)
def test_api_refuses_bad_limits_and_other_tokens_and_changes_nothing(api, pg, token, body, status, error):
    r = api.put("/api/v1/kinds/limited2/limits", json=body, headers=api.as_(token))
    assert (r.status_code, r.json()["error"]) == (status, error), r.text
    assert r.json()["detail"]
    assert stored_limits(pg) == {}


def test_api_refuses_a_kind_nobody_declares_unless_it_has_rows(api, pg, make_job):
    admin = api.as_("admin")
    r = api.put("/api/v1/kinds/no-such-kind/limits", json={"concurrency": 1}, headers=admin)
    assert (r.status_code, r.json()["error"]) == (404, "not_found")
    assert api.delete("/api/v1/kinds/no-such-kind/limits", headers=admin).status_code == 404
    assert stored_limits(pg) == {}
    make_job(pg, kind="retired", task="tests.apps.gone", status="succeeded")  # declared by no code any more
    r = api.put("/api/v1/kinds/retired/limits", json={"concurrency": 1}, headers=admin)
    assert r.status_code == 200 and r.json()["declared_concurrency"] is None
    assert stored_limits(pg) == {"retired": (1, None, None)}


def test_cli_limit_sets_none_and_default_and_limits_agrees(cli, pg):
    proc = cli("limit", "limited2", "--concurrency", "1")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.strip() == "limited2: concurrency 1 (from override), rate none (from code)"
    rows = by_kind_key(json.loads(cli("limits", "--json").stdout)["kinds"])
    assert (rows[("limited2", None)]["concurrency"], rows[("limited2", None)]["concurrency_source"]) == (1, "override")
    assert rows[("one_slot", None)]["concurrency"] == 1 and rows[("one_slot", None)]["concurrency_source"] == "code"
    proc = cli("limit", "rated", "--rate", "none", "--json")
    assert json.loads(proc.stdout)["rate_limit"] is None and json.loads(proc.stdout)["declared_rate_limit"] == "4/s"
    assert cli("limit", "limited2", "--concurrency", "default").stdout.strip().startswith("limited2: concurrency 2 (from code)")
    assert stored_limits(pg) == {"limited2": (None, None, None), "rated": (None, 0, None)}


def test_cli_limit_works_on_a_batched_kind(cli, pg):
    # (Once refused: a batch claim took no limit. Now its batches are bounded by it.)
    proc = cli("limit", "b_open", "--concurrency", "3")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.strip() == "b_open: concurrency 3 (from override), rate none (from code)"
    proc = cli("limit", "b_capped", "--rate", "7/s")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.strip() == "b_capped: concurrency 2 (from code), rate 7/s (from override)"
    assert stored_limits(pg) == {"b_open": (3, None, None), "b_capped": (None, 7, 1)}


@pytest.mark.parametrize(
    "args, says",
    [
        (("limit", "limited2"), "nothing to change"),
        (("limit", "limited2", "--concurrency", "0"), "concurrency must be"),
        (("limit", "limited2", "--rate", "5/d"), "rate limit must look like"),
        (("limit", "no-such-kind", "--concurrency", "1"), "no kind 'no-such-kind'"),
    ],
)
def test_cli_limit_refuses_bad_input_in_one_line_and_changes_nothing(cli, pg, args, says):
    proc = cli(*args)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.startswith("celery-lease: ") and says in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert stored_limits(pg) == {}


def test_an_override_binds_another_process_s_next_claims_at_once(pg, broker, client_app):
    """A kind the code leaves unlimited: the worker process's claims right after the
    operator's command returned take the override, though its list of overridden kinds
    was read just before the command (and would be trusted for seconds)."""
    from celery_lease.flow.limits import LimitChange

    worker = client_app(pg, broker, module=MODULE)
    operator = client_app(pg, broker, module=MODULE)  # another CeleryLease: the CLI's, the API's
    spec = worker.leases.registry.resolve("unlimited")
    ids = [j.id for j in worker.unlimited.submit_many([{}] * 4)]
    assert not worker.leases.flow.limited(spec)
    now = operator.leases.flow.set_limits("unlimited", LimitChange.parse(concurrency="1", given=(True, False)))
    assert now["concurrency"] == 1
    claimed = [worker.leases.flow.claim(i, spec, "w1@host/1/boot") for i in ids]
    assert sum(row is not None for row in claimed) == 1
    with sa.create_engine(pg).connect() as conn:
        states = sorted(conn.execute(sa.select(jobs.c.status, jobs.c.held).where(jobs.c.kind == "unlimited")).all())
    assert states == [("pending", "limit")] * 3 + [("running", None)]
