"""`kvtrace replay SESSION --sweep num-blocks=32,64,128 -o DIR`: one replay per value, all ingested into
DIR/sweep.duckdb and exported as a Parquet dataset (DIR/dataset), with a table (DIR/sweep.csv) and a
figure (DIR/sweep.png, .svg) of what changed against the swept setting: prefix-cache hit rate,
preemptions, and each request's queueing and completion, in engine steps (a replay's clock is the step).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError

SWEEPABLE = {"num-blocks": "num_blocks", "block-size": "block_size", "max-num-seqs": "max_num_seqs",
             "max-num-batched-tokens": "max_num_batched_tokens", "max-model-len": "max_model_len"}
MAX_POINTS = 64

COLUMNS = ("value", "session", "steps", "hit_rate", "preemptions", "mean_queue_steps", "mean_completion_steps")
# Per session: steps, hit rate, preemptions, and per request the steps from queued to first scheduled
# (queueing) and to finished (completion).
METRICS_SQL = """
WITH r AS (
    SELECT session, request_id, min(step) FILTER (event = 'queued') AS q,
        min(step) FILTER (event = 'scheduled') AS s, max(step) FILTER (event = 'finished') AS f
    FROM request_events GROUP BY ALL
)
SELECT x.session,
    (SELECT count(*) FROM steps t WHERE t.session = x.session) AS steps,
    (SELECT sum(hit_tokens) / nullif(sum(query_tokens), 0) FROM prefix_lookups p WHERE p.session = x.session),
    (SELECT count(*) FROM preemptions p WHERE p.session = x.session),
    avg(s - q), avg(f - q)
FROM r x GROUP BY x.session
"""


def parse_sweep(text: str) -> tuple[str, str, list[int]]:
    """'num-blocks=32,64' -> ('num-blocks', 'num_blocks', [32, 64]); a one-line error otherwise."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in SWEEPABLE:
        raise KvtraceError(f"--sweep {text!r}: expected SETTING=V1,V2,... with SETTING one of {', '.join(SWEEPABLE)}")
    try:
        points = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise KvtraceError(f"--sweep {text!r}: the values must be whole numbers") from None
    if not points or len(points) > MAX_POINTS or len(set(points)) != len(points):
        raise KvtraceError(f"--sweep {text!r}: give 1 to {MAX_POINTS} distinct values")
    return name, SWEEPABLE[name], points


def sweep(session_dir: str | Path, out_dir: str | Path, spec: str, overrides: dict[str, Any] | None = None,
          progress: bool = False) -> dict[str, Any]:
    from kvtrace.export.dataset import export_parquet
    from kvtrace.ingest import ingest
    from kvtrace.replay import read_workload, replay
    from kvtrace.store.db import open_db

    name, attr, points = parse_sweep(spec)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KvtraceError(f"{out}: exists and is not an empty folder; a sweep writes a folder of its own")
    workload = read_workload(session_dir)  # once: every point replays the same requests
    out.mkdir(parents=True, exist_ok=True)
    sessions: dict[str, int] = {}  # session directory -> swept value
    for i, v in enumerate(points):
        if progress:
            print(f"replay: {name}={v} ({i + 1}/{len(points)})", file=sys.stderr)
        r = replay(session_dir, out / f"{name}={v}", {**(overrides or {}), attr: v}, workload=workload)
        sessions[r["session_dir"]] = v
    db = out / "sweep.duckdb"
    reports = ingest(list(sessions), db)
    value_of = {rep["session"]: v for rep, v in zip(reports, sessions.values())}  # ingest keeps the order
    export_parquet([str(db)], out / "dataset")
    con = open_db(db, read_only=True)
    try:
        rows = sorted(((value_of[r[0]], *r) for r in con.execute(METRICS_SQL).fetchall()), key=lambda r: r[0])
    finally:
        con.close()
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow((name, *COLUMNS[1:]))
        w.writerows(rows)
    figure(rows, name, out / "sweep")
    return {"setting": name, "points": points, "rows": rows, "db": str(db), "dataset": str(out / "dataset")}


def figure(rows: list[tuple], name: str, path: Path) -> None:
    """Four panels against the swept setting: hit rate, preemptions, mean queueing, mean completion."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8.0, 5.2), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    xs = [r[0] for r in rows]
    panels = (("prefix-cache hit rate", 3), ("preemptions", 4), ("mean queueing (engine steps)", 5),
              ("mean completion (engine steps)", 6))
    for ax, (title, col) in zip(axes, panels):
        ys = [r[col] if r[col] is not None else float("nan") for r in rows]
        ax.plot(xs, ys, marker="o", color="tab:blue")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
        if col == 3:
            ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:.0%}")
        elif col == 4:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"kvtrace replay: the same requests at each {name}", fontsize=11)
    fig.savefig(path.with_suffix(".png"), dpi=120)
    fig.savefig(path.with_suffix(".svg"))
