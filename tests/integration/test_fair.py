"""Fair share across tenants, statement by statement, on PostgreSQL and SQLite: the key
a submit gives each job of a fair kind, the order claims take them in, a weight
change's re-spacing, and bad weights refused."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from celery_lease.db.schema import jobs, tenant_weights
from celery_lease.db.statements.claim import claim as claim_statement
from celery_lease.flow.fair import FairShare
from celery_lease.lifecycle.claim import claim_delivery

MODULE = "tests.apps.app_flow"
OWNER = "n/1/b"


@pytest.fixture(params=["postgresql", "sqlite"])
def mod(request, client_app):
    url = request.getfixturevalue("pg" if request.param == "postgresql" else "sqlite_url")
    return client_app(url, "memory://", module=MODULE)


def keys(mod, ids) -> list[float | None]:
    with mod.leases.store.durable.connect() as conn:
        got = dict(conn.execute(sa.select(jobs.c.id, jobs.c.fair_key).where(jobs.c.id.in_(ids))).all())
    return [got[i] for i in ids]


def claim_order(mod, n: int) -> list[str]:
    """The ids n claims take, each for a delivery of the oldest pending job (as the
    broker delivers wakeups in submit order)."""
    store, taken = mod.leases.store, []
    for _ in range(n):
        with store.durable.connect() as conn:
            oldest = conn.execute(
                sa.select(jobs.c.id).where(jobs.c.status == "pending").order_by(jobs.c.created_at, jobs.c.id).limit(1)
            ).scalar()
        row = claim_delivery(store, str(oldest), OWNER, mod.fair_import.name)
        assert row is not None
        taken.append(str(row["id"]))
    return taken


def test_a_tenant_steps_one_over_its_weight_from_the_head_and_a_late_tenant_starts_at_the_head(mod):
    a = [j.id for j in mod.fair_import.submit_many([{}] * 4, tenant="a")]
    assert keys(mod, a) == [1.0, 2.0, 3.0, 4.0]
    a.append(mod.fair_import.submit({}, tenant="a").id)  # after its own last key
    assert keys(mod, a)[-1] == 5.0
    b = [mod.fair_import.submit({}, tenant="b").id for _ in range(2)]
    assert keys(mod, b) == [2.0, 3.0]  # the head (1.0) plus one step, then after its own
    none = mod.fair_import.submit({}).id  # no tenant: one tenant of its own
    assert keys(mod, [none]) == [2.0]
    assert keys(mod, [mod.unlimited.submit({}, tenant="a").id]) == [None]  # not a fair kind


def test_claims_take_the_smallest_key_first_whatever_the_delivery(mod):
    a = [j.id for j in mod.fair_import.submit_many([{}] * 6, tenant="a")]
    b = [j.id for j in mod.fair_import.submit_many([{}] * 3, tenant="b")]
    taken = claim_order(mod, 6)
    # a1 (1.0); then a2 and b1 tie at 2.0 (a's is older), a3 and b2, ...
    assert taken == [a[0], a[1], b[0], a[2], b[1], a[3]]


def test_a_priority_comes_before_fair_order(mod):
    [mod.fair_import.submit({}, tenant="a").id for _ in range(3)]
    urgent = mod.fair_import.submit({}, tenant="a", priority=5).id
    assert claim_order(mod, 1) == [urgent]


def test_weights_space_keys_and_a_change_respaces_pending_jobs(mod):
    fair = FairShare(mod.leases.store)
    fair.set_weight("a", 4)
    a = [j.id for j in mod.fair_import.submit_many([{}] * 4, tenant="a")]
    assert keys(mod, a) == [0.25, 0.5, 0.75, 1.0]
    b = [j.id for j in mod.fair_import.submit_many([{}] * 2, tenant="b")]
    assert keys(mod, b) == [1.25, 2.25]  # head 0.25 + 1, + 1
    row = fair.set_weight("b", "2")
    assert keys(mod, b) == [0.75, 1.25]  # from the head, at steps of 1/2
    assert row == {"tenant": "b", "weight": 2.0, "pending": 2, "running": 0, "share": round(2 / 6, 4)}
    fair.set_weight("a", "default")
    assert keys(mod, a) == [1.25, 2.25, 3.25, 4.25]
    listed = {r["tenant"]: r for r in fair.tenants()}
    assert listed["a"]["weight"] == 1.0 and listed["a"]["pending"] == 4 and listed["b"]["weight"] == 2.0


@pytest.mark.parametrize("bad", [0, -1, "0", "-2.5", "lots", "", "nan", "inf", True, [3]])
def test_a_bad_weight_is_refused_and_changes_nothing(mod, bad):
    fair = FairShare(mod.leases.store)
    fair.set_weight("a", 3)
    a = [j.id for j in mod.fair_import.submit_many([{}] * 2, tenant="a")]
    before = keys(mod, a)
    with pytest.raises(ValueError, match="weight must be"):
        fair.set_weight("a", bad)
    assert keys(mod, a) == before
    with mod.leases.store.durable.connect() as conn:
        assert conn.execute(sa.select(tenant_weights.c.weight)).scalars().all() == [3.0]


def test_a_bad_tenant_is_refused(mod):
    fair = FairShare(mod.leases.store)
    for bad in ("", "x" * 201, 5):
        with pytest.raises(ValueError, match="tenant"):
            fair.set_weight(bad, 2)


def test_a_fair_claim_walks_the_fair_index_whatever_the_backlog(pg, client_app):
    """The claim of a fair kind with 20,000 pending jobs of 1,000 tenants: one ordered
    walk of celery_lease_jobs_fair that stops at its first row, never a sort of the
    kind's pending jobs (which would also cost enough to have the statement JIT-compiled)."""
    mod = client_app(pg, "memory://", module=MODULE)
    store = mod.leases.store
    with store.durable.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO celery_lease_jobs (id, kind, task, queue, status, max_attempts, lease_seconds, payload,"
                " tenant, created_at, updated_at, fair_key)"
                " SELECT gen_random_uuid(), 'fair_import', :task, 'celery', 'pending', 1, 30, '{}',"
                " 't' || (i % 1000), now(), now(), i / 1000 + 1 FROM generate_series(0, 19999) AS i"
            ),
            {"task": mod.fair_import.name},
        )
    with store.durable.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE celery_lease_jobs")
        delivered = conn.execute(sa.select(jobs.c.id).order_by(jobs.c.fair_key.desc()).limit(1)).scalar()
        stmt = claim_statement("postgresql")
        compiled = stmt.compile(dialect=conn.dialect)
        params = {**compiled.params, "job_id": str(delivered), "owner": OWNER, "wakeup_task": mod.fair_import.name, "token": 1}
        plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), params))
    walked = [line for line in plan.splitlines() if "celery_lease_jobs_fair on celery_lease_jobs best" in line]
    assert walked and "Seq Scan on celery_lease_jobs best" not in plan, plan
    assert float(plan.splitlines()[0].split("..")[1].split()[0]) < 10_000, plan  # far below jit_above_cost


def test_a_batch_of_a_fair_kind_is_a_weighted_mix(pg, client_app):
    from celery_lease.db.statements.many_claim import claim_many

    mod = client_app(pg, "memory://", module=MODULE)
    FairShare(mod.leases.store).set_weight("b", 2)
    a = [j.id for j in mod.fair_import.submit_many([{}] * 8, tenant="a")]
    b = [j.id for j in mod.fair_import.submit_many([{}] * 8, tenant="b")]
    params = {"job_id": a[-1], "wakeup_task": mod.fair_import.name, "n": 6, "owner": OWNER, "token": 7}
    with mod.leases.store.durable.begin() as conn:
        rows = conn.execute(claim_many(), params).mappings().all()
    # Keys: a 1, 2, 3, ...; b (weight 2, from the head 1) 1.5, 2, 2.5, 3, ...
    assert {str(r["id"]) for r in rows} == {a[0], b[0], a[1], b[1], b[2], a[2]}
