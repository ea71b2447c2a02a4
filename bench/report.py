"""JSON, a markdown table and a PNG chart of a run."""

from __future__ import annotations

import json
from pathlib import Path

LABELS = {
    "celery": "plain Celery",
    "lease-pg": "celery-lease (PostgreSQL)",
    "lease-sqlite": "celery-lease (SQLite)",
    "procrastinate": "procrastinate",
    "pgqueuer": "pgqueuer",
}

TARGETS = [
    # (what, system, metric, test, bound, how the bound reads)
    ("end-to-end no-op vs plain Celery", "lease-pg", ("ratio", "e2e_rate"), ">=", 0.85, "≥ 0.85×"),
    ("drain no-op vs plain Celery", "lease-pg", ("ratio", "drain_rate"), ">=", 0.90, "≥ 0.9×"),
    ("submit_many on PostgreSQL (jobs/s)", "lease-pg", ("submit_many_rate",), ">=", 10_000, "≥ 10,000/s"),
    ("worker peak RSS vs plain Celery (MB)", "lease-pg", ("rss_delta_mb",), "<=", 15, "≤ +15 MB"),
]


def _get(row: dict, path: tuple) -> float | None:
    value = row
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _fmt(value, spec: str = ",.0f") -> str:
    return "–" if value is None else format(value, spec)


def _ratio(row: dict, metric: str) -> str:
    r = _get(row, ("ratio", metric))
    return "" if r is None or row["system"] == "celery" else f" ({r:.2f}×)"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Medians of {meta['reps']} interleaved repetitions; ratios (×) are to plain Celery in the "
        f"same repetition. N = {meta['n_noop']} no-op, {meta['n_sleep']} 10 ms jobs "
        f"(drain: 2N). {meta['when']}, {meta['machine']}.",
        "",
        "| system | body | submit/s | batch submit/s | end-to-end/s | drain/s | p50 ms | p99 ms "
        "| stmts/job submit | stmts/job worker | xacts/job worker | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        stmts_p = row.get("producer_statements_per_job", row.get("producer_xacts_per_job"))
        stmts_w = row.get("worker_statements_per_job", row.get("worker_xacts_per_job"))
        rss_delta = row.get("rss_delta_mb")
        rss = _fmt(row["peak_rss_mb"], ".0f") + ("" if row["system"] == "celery" or rss_delta is None else f" ({rss_delta:+.0f})")
        lines.append(
            f"| {LABELS.get(row['system'], row['system'])} | {row['body']} "
            f"| {_fmt(row['submit_rate'])}{_ratio(row, 'submit_rate')} "
            f"| {_fmt(row['submit_many_rate'])}{_ratio(row, 'submit_many_rate')} "
            f"| {_fmt(row['e2e_rate'])}{_ratio(row, 'e2e_rate')} "
            f"| {_fmt(row['drain_rate'])}{_ratio(row, 'drain_rate')} "
            f"| {_fmt(row['latency_p50_ms'], '.2f')} | {_fmt(row['latency_p99_ms'], '.2f')} "
            f"| {_fmt(stmts_p, '.2f')} | {_fmt(stmts_w, '.2f')} "
            f"| {_fmt(row.get('worker_xacts_per_job'), '.2f')} | {rss} |"
        )
    lines += ["", "Targets (celery-lease on PostgreSQL, no-op jobs):", ""]
    by = {(r["system"], r["body"]): r for r in rows}
    for what, system, path, test, bound, reads in TARGETS:
        row = by.get((system, "noop"))
        value = None if row is None else _get(row, path)
        if value is None:
            lines.append(f"- {what}: not measured")
            continue
        ok = value >= bound if test == ">=" else value <= bound
        lines.append(f"- {what}: {value:,.2f} (target {reads}) — {'met' if ok else 'NOT met'}")
    lease = by.get(("lease-pg", "noop"))
    if lease is not None:
        for other in ("procrastinate", "pgqueuer"):
            row = by.get((other, "noop"))
            if row is not None:
                ahead = lease["e2e_rate"] > row["e2e_rate"]
                lines.append(
                    f"- end-to-end no-op ahead of {other}: {lease['e2e_rate']:,.0f}/s vs "
                    f"{row['e2e_rate']:,.0f}/s — {'met' if ahead else 'NOT met'}"
                )
        if "worker_statements" in lease:
            parts = ", ".join(f"{k} {v:g}" for k, v in lease["worker_statements"].items())
            lines += ["", f"celery-lease (PostgreSQL) worker statements per no-op job: {parts}."]
            parts = ", ".join(f"{k} {v:g}" for k, v in lease["producer_statements"].items())
            lines.append(f"celery-lease (PostgreSQL) statements per single submit: {parts}.")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bodies = [b for b in ("noop", "sleep10") if any(r["body"] == b for r in rows)]
    fig, axes = plt.subplots(1, len(bodies), figsize=(6.5 * len(bodies), 4.5), squeeze=False)
    for ax, body in zip(axes[0], bodies):
        group = [r for r in rows if r["body"] == body]
        names = [LABELS.get(r["system"], r["system"]).replace(" (", "\n(") for r in group]
        xs = range(len(group))
        for offset, metric, label in ((-0.2, "e2e_rate", "end to end"), (0.2, "drain_rate", "drain")):
            values = [r[metric] for r in group]
            lo = [r[metric] - r[f"{metric}_range"][0] for r in group]
            hi = [r[f"{metric}_range"][1] - r[metric] for r in group]
            ax.bar([x + offset for x in xs], values, width=0.4, label=label, yerr=[lo, hi], capsize=3)
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel("jobs/s (median, min–max over reps)")
        ax.set_title(f"{body} jobs, N={group[0]['n']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results_dir: Path, meta: dict, cells: list[dict], rows: list[dict]) -> str:
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "latest.json").write_text(json.dumps({"meta": meta, "summary": rows, "cells": cells}, indent=2, default=str))
    table = markdown(rows, meta)
    (results_dir / "latest.md").write_text(table)
    chart(rows, results_dir / "latest.png")
    return table
