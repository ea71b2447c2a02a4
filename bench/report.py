"""The run's outputs: latest.json, latest.md (the figures table, then the details) and a
PNG chart.

The figures table has one row per target of issues #12 and #22 (celery-lease on
PostgreSQL, no-op jobs, against plain Celery in the same repetition), each with its
goal and whether the run met it, and a "before" column when ``--before`` names an
earlier run's latest.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.cpu import PART_LABELS, PARTS, PG_COLUMNS, pg_cells

LABELS = {
    "celery": "plain Celery",
    "lease-pg": "celery-lease (PostgreSQL)",
    "lease-pg-limited": "celery-lease (PostgreSQL, flow-controlled)",
    "lease-batch": "celery-lease (PostgreSQL, batch=100)",
    "lease-sqlite": "celery-lease (SQLite)",
    "procrastinate": "procrastinate",
    "pgqueuer": "pgqueuer",
}
BODY_LABELS = {"noop": "no-op", "sleep1": "1 ms", "sleep10": "10 ms"}
#: Systems compared with another celery-lease system as well as with plain Celery: the
#: flow-control cost is lease-pg-limited over lease-pg (see systems.FACTORIES).
BASELINES = {"lease-pg-limited": "lease-pg"}
#: Issue #22: PostgreSQL CPU per no-op job, µs (the system's own backends, figure 8.).
PG_CPU_GOAL_US = 150
#: The PostgreSQL systems of the "database per drained job" table.
PG_SYSTEMS = ("lease-pg", "lease-batch", "lease-pg-limited", "procrastinate", "pgqueuer")
#: Sizes the maintenance goals are stated at.
GOAL_TERMINAL_ROWS = 1_000_000
GOAL_EXPIRED = 100_000
GOAL_BACKLOG = (100_000, 1_000_000)
#: "Flat in the backlog": the tick at the largest backlog is at most this many times the
#: tick at the smallest (a scan proportional to the backlog would be ~10x at 10x rows).
FLAT = 2.0


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


def _figure(what: str, value: float | None, shown: str, goal: str, ok: bool | None, note: str = "") -> dict:
    return {"figure": what, "value": value, "shown": shown, "goal": goal, "met": ok, "note": note}


def figures(rows: list[dict], scale: dict | None) -> list[dict]:
    """The issue's table: one entry per figure (value None: not measured in this run)."""
    by = {(r["system"], r["body"]): r for r in rows}
    lease = by.get(("lease-pg", "noop"), {})
    out = []

    def ratio(what, row, metric, bound):
        v = _get(row, ("ratio", metric))
        out.append(_figure(what, v, "–" if v is None else f"{v:.2f}×", f"≥ {bound:.2f}×", None if v is None else v >= bound))

    ratio("end to end, no-op jobs, ratio to plain Celery", lease, "e2e_rate", 0.85)
    ratio("drain, ratio", lease, "drain_rate", 0.90)
    # A batched kind (lease-batch: batch=100, docs/flow-control.md#batched-kinds).
    ratio("batched kind (`batch=100`) drain, ratio", by.get(("lease-batch", "noop"), {}), "drain_rate", 2.0)
    ratio("single `submit`, ratio to `.delay`", lease, "submit_rate", 0.70)
    v = lease.get("submit_many_rate")
    out.append(
        _figure(
            "`submit_many`, PostgreSQL", v, "–" if v is None else f"{v:,.0f}/s", "≥ 15,000/s", None if v is None else v >= 15_000
        )
    )
    v = lease.get("cpu_delta_us")
    out.append(
        _figure(
            "extra CPU per job over plain Celery, all processes",
            v,
            "–" if v is None else f"{v:+,.0f} µs",
            "≤ +250 µs",
            None if v is None else v <= 250,
        )
    )
    v = lease.get("rss_delta_mb")
    out.append(
        _figure(
            "worker peak RSS over plain Celery",
            v,
            "–" if v is None else f"{v:+.1f} MB",
            "≤ +10 MB",
            None if v is None else v <= 10,
        )
    )
    v = _get(lease, ("cpu_us", "postgres"))
    out.append(
        _figure(
            "PostgreSQL CPU per drained job (the system's backends)",
            v,
            "–" if v is None else f"{v:,.0f} µs",
            f"≤ {PG_CPU_GOAL_US} µs",
            None if v is None else v <= PG_CPU_GOAL_US,
        )
    )
    if scale is None:
        for what in ("idle reap/sweep tick, 1M terminal rows", "100k expired leases reaped", "sweep tick, fresh pending backlog"):
            out.append(_figure(what, None, "–", "", None, "scale not run"))
        return out
    rows_n = scale["rows"]
    size_note = "" if rows_n >= GOAL_TERMINAL_ROWS else f"at {rows_n:,} rows; the goal is at {GOAL_TERMINAL_ROWS:,}"
    reap_ms, sweep_ms = scale["full"]["reap_idle"]["median_ms"], scale["full"]["sweep_idle"]["median_ms"]
    worst = max(reap_ms, sweep_ms)
    out.append(
        _figure(
            f"idle reap/sweep tick, {rows_n:,} terminal rows",
            worst,
            f"reap {reap_ms:.2f} ms, sweep {sweep_ms:.2f} ms",
            "< 1 ms",
            worst < 1.0,
            size_note,
        )
    )
    reap = scale.get("reap_expired")
    if reap:
        note = "" if reap["rows"] >= GOAL_EXPIRED else f"{reap['rows']:,} rows; the goal is at {GOAL_EXPIRED:,}"
        out.append(
            _figure(
                f"{reap['rows']:,} expired leases reaped",
                reap["rows_per_s"],
                f"{reap['rows_per_s']:,.0f} rows/s",
                "≥ 20,000 rows/s",
                reap["rows_per_s"] >= 20_000,
                note,
            )
        )
    backlog = scale.get("sweep_backlog") or {}
    for size, fig in backlog.items():
        ms = fig["median_ms"]
        note = f"sent {fig['sent']} wakeups" if fig["sent"] else ""
        out.append(_figure(f"sweep tick, fresh pending backlog of {int(size):,}", ms, f"{ms:.2f} ms", "< 5 ms", ms < 5.0, note))
    if len(backlog) >= 2:
        sizes = sorted(backlog, key=int)
        lo, hi = backlog[sizes[0]]["median_ms"], backlog[sizes[-1]]["median_ms"]
        growth = hi / lo if lo else float("inf")
        note = (
            ""
            if tuple(int(s) for s in sizes) == GOAL_BACKLOG
            else f"the goal compares {GOAL_BACKLOG[0]:,} and {GOAL_BACKLOG[1]:,}"
        )
        out.append(
            _figure(
                f"sweep tick flat in the backlog ({int(sizes[0]):,} → {int(sizes[-1]):,})",
                growth,
                f"{growth:.2f}× the time at {int(sizes[-1]) // int(sizes[0])}× the rows",
                f"≤ {FLAT:g}×",
                growth <= FLAT,
                note,
            )
        )
    return out


def informational(rows: list[dict]) -> list[dict]:
    """Ratios with a body beside no-op, memory with shared pages counted once, and the
    flow-control cost: no goal."""
    by = {(r["system"], r["body"]): r for r in rows}
    out = []
    v = _get(by.get(("lease-pg", "noop")) or {}, ("pss_delta_mb",))
    if v is not None:
        out.append(_figure("worker peak PSS over plain Celery (shared pages counted once)", v, f"{v:+.1f} MB", "–", None))
    for body in ("sleep1", "sleep10"):
        row = by.get(("lease-pg", body))
        if row is None:
            continue
        for metric, what in (("e2e_rate", "end to end"), ("drain_rate", "drain")):
            v = _get(row, ("ratio", metric))
            if v is not None:
                out.append(_figure(f"{what}, {BODY_LABELS[body]} jobs, ratio to plain Celery", v, f"{v:.2f}×", "–", None))
    for system, base in BASELINES.items():
        for body in BODY_LABELS:
            row, ref = by.get((system, body)), by.get((base, body))
            if row is None or ref is None:
                continue
            for metric, what in (("e2e_rate", "end to end"), ("drain_rate", "drain")):
                v = row[metric] / ref[metric]
                out.append(
                    _figure(f"{LABELS[system]}: {what}, {BODY_LABELS[body]}, ratio to {LABELS[base]}", v, f"{v:.2f}×", "–", None)
                )
    return out


def figures_table(figs: list[dict], before: list[dict] | None = None) -> str:
    prior = {f["figure"]: f for f in before or []}
    head = "| figure | before | value | goal | met? |" if before is not None else "| figure | value | goal | met? |"
    lines = [head, "|---|" + ("---:|" if before is not None else "") + "---:|---|---|"]
    for f in figs:
        met = "–" if f["met"] is None else ("met" if f["met"] else "**NOT met**")
        if f["note"]:
            met += f" ({f['note']})"
        cells = [f["figure"]]
        if before is not None:
            cells.append(prior[f["figure"]]["shown"] if f["figure"] in prior else "–")
        cells += [f["shown"], f["goal"] or "–", met]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cpu_table(rows: list[dict], body: str = "noop") -> str:
    lines = [
        "| system | " + " | ".join(PART_LABELS[p] for p in PARTS) + " | total | over plain Celery |",
        "|---|" + "---:|" * (len(PARTS) + 2),
    ]
    for row in rows:
        us = row.get("cpu_us")
        if row["body"] != body or us is None:
            continue
        delta = row.get("cpu_delta_us")
        lines.append(
            f"| {LABELS.get(row['system'], row['system'])} | "
            + " | ".join(f"{us[p]:,.0f}" for p in PARTS)
            + f" | {us['total']:,.0f} | {'–' if delta is None or row['system'] == 'celery' else f'{delta:+,.0f}'} |"
        )
    return "\n".join(lines) + "\n"


def pg_table(rows: list[dict], body: str = "noop") -> str:
    """Per drained job, each PostgreSQL system's database: backend CPU, WAL bytes and
    commit records of its own transactions, the cluster's WAL fsyncs, and the share of
    its job table's updates that were HOT (bench/cpu.py, PgMeter)."""
    lines = [
        "| system | drain/s | PostgreSQL CPU µs | " + " | ".join(label for label, _ in PG_COLUMNS.values()) + " |",
        "|---|---:|---:|" + "---:|" * len(PG_COLUMNS),
    ]
    order = {name: i for i, name in enumerate(PG_SYSTEMS)}
    for row in sorted((r for r in rows if r["body"] == body and r["system"] in order), key=lambda r: order[r["system"]]):
        cpu = _get(row, ("cpu_us", "postgres"))
        lines.append(
            f"| {LABELS.get(row['system'], row['system'])} | {_fmt(row.get('drain_rate'))} | {_fmt(cpu)} | "
            + " | ".join(pg_cells(row))
            + " |"
        )
    return "\n".join(lines) + "\n"


def markdown(
    rows: list[dict], meta: dict, scale: dict | None = None, before: list[dict] | None = None, cells: list[dict] | None = None
) -> str:
    cells = cells or []
    sizes = ", ".join(f"{n} {BODY_LABELS[b]}" for b, n in meta["sizes"].items() if n)
    lines = [
        f"# celery-lease bench, {meta['when']}",
        "",
        f"{meta['machine']}; {meta['reps']} interleaved repetition(s); N = {sizes} jobs per phase "
        f"(drain: 2N); {meta['seconds']:.0f}s in all." + (f" {meta['note']}" if meta.get("note") else ""),
        "",
        "## Figures (issues #12 and #22)",
        "",
        "celery-lease on PostgreSQL, no-op jobs; ratios and differences are to plain Celery in the same "
        "repetition (medians over repetitions).",
        "",
        figures_table(figures(rows, scale), before).rstrip("\n"),
        "",
        "Beside no-op (no goal):",
        "",
        figures_table(informational(rows), None).rstrip("\n"),
        "",
        "## CPU µs per no-op job during a drain, by process",
        "",
        cpu_table(rows).rstrip("\n"),
        "",
        "## The database per drained no-op job",
        "",
        "WAL bytes and commits: records of the system's own database (pg_walinspect); WAL fsyncs: "
        "pg_stat_wal of the whole cluster (other databases' commits count too); HOT updates: the share of "
        "its job table's updates that wrote no index entry.",
        "",
        pg_table(rows).rstrip("\n"),
        "",
        "## Every system and body",
        "",
        "| system | body | submit/s | batch submit/s | end-to-end/s | drain/s | p50 ms | p99 ms "
        "| stmts/job submit | stmts/job worker | xacts/job worker | CPU µs/job | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
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
            f"| {_fmt(row.get('worker_xacts_per_job'), '.2f')} | {_fmt(_get(row, ('cpu_us', 'total')))} | {rss} |"
        )
    by = {(r["system"], r["body"]): r for r in rows}
    lease = by.get(("lease-pg", "noop"))
    lines.append("")
    stalled = [c for c in cells if c.get("rescued")]
    if stalled:
        where = ", ".join(f"{c['system']} {c['body']} rep {c['rep']}: {c['rescued']}" for c in stalled)
        lines += [
            f"**Jobs left running by a worker and rescued by the bench** ({where}): no job finished for "
            "7 s, so the bench reaped their expired 5 s leases as beat would; those cells' figures include the stall.",
            "",
        ]
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
    if scale is not None:
        from bench import scale as scale_mod

        lines += ["", "## Table size (`python -m bench scale`)", "", scale_mod.markdown(scale).rstrip("\n")]
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bodies = [b for b in BODY_LABELS if any(r["body"] == b for r in rows)]
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
        ax.set_title(f"{BODY_LABELS[body]} jobs, N={group[0]['n']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(
    results_dir: Path,
    meta: dict,
    cells: list[dict],
    rows: list[dict],
    scale: dict | None = None,
    before: list[dict] | None = None,
) -> str:
    results_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "figures": figures(rows, scale), "summary": rows, "scale": scale, "cells": cells}
    (results_dir / "latest.json").write_text(json.dumps(doc, indent=2, default=str))
    table = markdown(rows, meta, scale, before, cells)
    (results_dir / "latest.md").write_text(table)
    chart(rows, results_dir / "latest.png")
    return table
