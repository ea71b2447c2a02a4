"""A small shop database to extract from: the demo's and the tests' source.

Deterministic (seeded), so two builds of the same size hold the same rows.
"""

from __future__ import annotations

import random
from datetime import date, timedelta

import sqlalchemy as sa

metadata = sa.MetaData()

customers = sa.Table(
    "customers",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(80), nullable=False),
    sa.Column("email", sa.String(120), nullable=False),
    sa.Column("country", sa.String(2), nullable=False),
    sa.Column("vip", sa.Boolean, nullable=False),
)
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("customer_id", sa.Integer, nullable=False),
    sa.Column("ordered_on", sa.Date, nullable=False),
    sa.Column("total", sa.Float, nullable=False),
    sa.Column("status", sa.String(12), nullable=False),
)
payments = sa.Table(
    "payments",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("order_id", sa.Integer, nullable=False),
    sa.Column("amount", sa.Numeric(12, 2), nullable=False),
    sa.Column("method", sa.String(12), nullable=False),
)

#: Rows per table for size 1; ``build(url, rows=N)`` scales them to N rows in all.
SHARES = {"customers": 0.2, "orders": 0.5, "payments": 0.3}


def build(url: str, rows: int = 40_000, seed: int = 7) -> dict[str, int]:
    """Create (or recreate) the three tables at ``url`` with about ``rows`` rows in
    all; returns the row count of each table."""
    rnd = random.Random(seed)
    counts = {name: max(1, int(rows * share)) for name, share in SHARES.items()}
    engine = sa.create_engine(url)
    try:
        metadata.drop_all(engine)
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(
                customers.insert(),
                [
                    {
                        "id": i,
                        "name": f"Customer {i}",
                        "email": f"c{i}@example.com",
                        "country": rnd.choice(["DE", "FR", "NL", "US", "JP"]),
                        "vip": rnd.random() < 0.1,
                    }
                    for i in range(1, counts["customers"] + 1)
                ],
            )
            start = date(2025, 1, 1)
            conn.execute(
                orders.insert(),
                [
                    {
                        "id": i,
                        "customer_id": rnd.randint(1, counts["customers"]),
                        "ordered_on": start + timedelta(days=rnd.randint(0, 364)),
                        "total": round(rnd.uniform(5, 500), 2),
                        "status": rnd.choice(["new", "paid", "shipped"]),
                    }
                    for i in range(1, counts["orders"] + 1)
                ],
            )
            conn.execute(
                payments.insert(),
                [
                    {
                        "id": i,
                        "order_id": rnd.randint(1, counts["orders"]),
                        "amount": f"{rnd.uniform(5, 500):.2f}",
                        "method": rnd.choice(["card", "iban", "paypal"]),
                    }
                    for i in range(1, counts["payments"] + 1)
                ],
            )
    finally:
        engine.dispose()
    return counts
