"""Figures and a static HTML page from the canned queries: one database (`write_report`), or several
sessions side by side (`compare`).

    from kvtrace.export.report import write_report, compare
    write_report("run1.duckdb", "report/")            # PNG + SVG figures and report/index.html
    columns, rows = compare(["a.duckdb", "b.duckdb"])  # one row per metric, one column per session
    compare(["a.duckdb", "b.duckdb"], "cmp/")          # the same table, plus overlaid figures and cmp/index.html

Everything is computed by the canned queries in `queries/` (the numbers on the page are the ones
`kvtrace query` prints); figures are drawn with matplotlib's object API (`matplotlib.figure.Figure`,
Agg canvas: no display, no global pyplot state). The HTML page uses no network: images are relative
files next to it. Runs in the calling process; a database is opened read-only.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError

FIGURES = ("access_pattern", "kv_utilization", "step_time_fit", "turn_latency", "admission_limits",
           "forward_pass_throughput", "recompute_vs_swap")
ACCESS_POINTS = 200_000  # access-pattern points drawn per session (evenly sampled past it)
SVG_META = {"Date": None}  # no timestamp in the SVG: the same data gives the same file
# Text stays text in the SVG (searchable, smaller); a fixed hash salt keeps element ids stable.
RC = {"svg.fonttype": "none", "svg.hashsalt": "kvtrace"}


class Series:
    """One session's results, the unit the figures and the comparison table take."""

    def __init__(self, label: str, con: Any, session: str, db: Path):
        self.label, self.con, self.session, self.db = label, con, session, db
        self._cache: dict[tuple, list[dict]] = {}

    def q(self, name: str, **params) -> list[dict]:
        """Rows of canned query `name` for this session, as dicts (cached)."""
        from kvtrace.queries import run_query

        key = (name, tuple(sorted(params.items())))
        if key not in self._cache:
            cols, rows = run_query(self.con, name, {"session": self.session, **params})
            self._cache[key] = [dict(zip(cols, r)) for r in rows]
        return self._cache[key]


def _open(db_path: str | Path):
    from kvtrace.store.db import open_db

    con = open_db(db_path, read_only=True)
    sessions = [r[0] for r in con.execute("SELECT session FROM sessions ORDER BY session").fetchall()]
    if not sessions:
        con.close()
        raise KvtraceError(f"{db_path}: no sessions in this database (kvtrace ingest SESSION -o {db_path})")
    return con, sessions


def _series(db_paths: Sequence[str | Path]) -> tuple[list[Series], list[Any]]:
    """One Series per session of each database, labelled by the database's name when every database holds
    one session and the names differ, else by session id (prefixed by the database name if ids repeat)."""
    opened, cons = [], []
    try:
        for p in db_paths:
            con, sessions = _open(p)
            cons.append(con)
            opened.append((Path(p), con, sessions))
    except BaseException:
        for con in cons:
            con.close()
        raise
    stems = [p.stem for p, _, _ in opened]
    by_stem = len(opened) > 1 and all(len(s) == 1 for _, _, s in opened) and len(set(stems)) == len(stems)
    ids = [sid for _, _, ss in opened for sid in ss]
    series: list[Series] = []
    for path, con, sessions in opened:
        for sid in sessions:
            label = path.stem if by_stem else (sid if ids.count(sid) == 1 else f"{path.stem}:{sid}")
            seen = sum(1 for s in series if s.label == label or s.label.startswith(label + " #"))
            series.append(Series(label if not seen else f"{label} #{seen + 1}", con, sid, path))
    return series, cons


# ---- metrics: one row of the comparison table each ------------------------------------------------------

def _sum(rows, col):
    vals = [r[col] for r in rows if r.get(col) is not None]
    return sum(vals) if vals else None


def _mean(rows, col):
    vals = [r[col] for r in rows if r.get(col) is not None]
    return sum(vals) / len(vals) if vals else None


def _median(rows, col):
    vals = sorted(r[col] for r in rows if r.get(col) is not None)
    if not vals:
        return None
    m = len(vals) // 2
    return vals[m] if len(vals) % 2 else (vals[m - 1] + vals[m]) / 2


def _ratio(a, b):
    return a / b if a is not None and b else None


def _phase_rate(s: Series, phase: str):
    rows = s.q("forward_pass_throughput", phase=phase)
    return _ratio(_sum(rows, "tokens"), _sum(rows, "forward_ms") and _sum(rows, "forward_ms") / 1e3)


def _admission_share(reason: str) -> Callable[[Series], Any]:
    def f(s: Series):
        rows = s.q("admission_limits")
        return next((r["share"] for r in rows if r["reason"] == reason), 0.0 if rows else None)
    return f


def _fit(col: str) -> Callable[[Series], Any]:
    def f(s: Series):
        rows = s.q("step_time_fit")
        return rows[0][col] if rows else None
    return f


def _prefix(col: str) -> Callable[[Series], Any]:
    def f(s: Series):
        rows = s.q("prefix_hits", by="step")
        q = _sum(rows, "query_tokens")
        return _ratio(_sum(rows, col), q)
    return f


def _waste(s: Series):
    rows = s.q("fragmentation")
    return _ratio(100.0 * (_sum(rows, "wasted_slots") or 0), _sum(rows, "allocated_slots"))


def _ended_share(s: Series):
    rows = s.q("block_lifetimes")
    return _ratio(sum(1 for r in rows if r["end_event"] == "evict"), len(rows))


def _finished(s: Series) -> int:
    """Requests of the session that finished (from `requests`: with or without job ids)."""
    (n,), = s.con.execute("SELECT count(*) FROM requests WHERE session = ? AND finish_ns IS NOT NULL",
                          [s.session]).fetchall()
    return n


def _pins_reused(s: Series):
    rows = s.q("pins")
    return _ratio(sum(1 for r in rows if r["reused"]), len(rows))


METRICS: list[tuple[str, str, Callable[[Series], Any]]] = [
    ("steps", "count", lambda s: len(s.q("forward_pass_throughput"))),
    ("requests finished", "count", lambda s: _finished(s)),
    ("prefill-only tokens/s", "tokens/s", lambda s: _phase_rate(s, "prefill-only")),
    ("decode-only tokens/s", "tokens/s", lambda s: _phase_rate(s, "decode-only")),
    ("mixed tokens/s", "tokens/s", lambda s: _phase_rate(s, "mixed")),
    ("mean step time", "ms", lambda s: _mean(s.q("forward_pass_throughput"), "step_ms")),
    ("mean context utilization", "fraction", lambda s: _mean(s.q("context_utilization"), "utilization")),
    ("steps with chunked prefill", "fraction",
     lambda s: _ratio(sum(1 for r in s.q("context_utilization") if r["chunked"]), len(s.q("context_utilization")))),
    ("step-time fit: slope", "us/token", _fit("slope_us_per_token")),
    ("step-time fit: intercept", "ms", _fit("intercept_ms")),
    ("step-time fit: R2", "", _fit("r2")),
    ("step-time fit: n", "steps", _fit("n")),
    *[(f"admission stopped by {r}", "fraction of steps", _admission_share(r))
      for r in ("tok-budget", "max-seqs", "kv-insuf", "preempted", "none")],
    ("prefix hit rate (local)", "fraction", _prefix("hit_tokens")),
    ("prefix hit rate (external)", "fraction", _prefix("external_hit_tokens")),
    ("mean turn latency", "ms", lambda s: _ratio(sum(r["latency_mean_ms"] * r["requests"] for r in s.q("turn_latency")),
                                                 sum(r["requests"] for r in s.q("turn_latency")))),
    ("mean job completion time", "ms", lambda s: _mean(s.q("job_completion"), "jct_ms")),
    ("max job completion time", "ms", lambda s: max((r["jct_ms"] for r in s.q("job_completion")
                                                      if r["jct_ms"] is not None), default=None)),
    ("preemptions", "count", lambda s: len(s.q("preemptions"))),
    ("tokens lost to preemption", "tokens", lambda s: _sum(s.q("preemptions"), "computed_tokens_lost") or 0),
    ("resume: recompute time", "ms", lambda s: _sum(s.q("recompute_vs_swap"), "recompute_ms") or 0.0),
    ("resume: connector load time", "ms", lambda s: _sum(s.q("recompute_vs_swap"), "load_ms") or 0.0),
    ("resume: bytes loaded", "bytes", lambda s: _sum(s.q("recompute_vs_swap"), "load_bytes") or 0),
    ("mean KV usage", "%", lambda s: _mean(s.q("kv_utilization"), "usage_pct")),
    ("peak KV usage", "%", lambda s: max((r["usage_pct"] for r in s.q("kv_utilization")
                                         if r["usage_pct"] is not None), default=None)),
    ("external tier stored", "bytes", lambda s: max((r["ext_stored_bytes"] or 0 for r in s.q("kv_utilization")),
                                                    default=None)),
    ("memory waste (fragmentation)", "%", _waste),
    ("block residencies", "count", lambda s: len(s.q("block_lifetimes"))),
    ("residencies ended by eviction", "fraction", _ended_share),
    ("median block lifetime", "ms", lambda s: _median(s.q("block_lifetimes"), "lifetime_ms")),
    ("median idle before eviction", "ms",  # residencies that ended by eviction only (not re-handed-out ones)
     lambda s: _median([r for r in s.q("block_lifetimes") if r["end_event"] == "evict"], "idle_before_end_ms")),
    ("KV idle share per layer (mean)", "fraction", lambda s: _mean(s.q("kv_idle_gaps", by="layer"), "idle_share")),
    ("mean gap between a layer's KV accesses", "ms",
     lambda s: _mean(s.q("kv_idle_gaps", by="layer"), "gap_mean_ms")),
    ("pins and holds", "count", lambda s: len(s.q("pins"))),
    ("pins reused before they ended", "fraction", _pins_reused),
]


def _table(series: list[Series]) -> tuple[list[str], list[tuple]]:
    columns = ["metric", "unit", *[s.label for s in series]]
    rows = []
    for name, unit, fn in METRICS:
        values = []
        for s in series:
            try:
                v = fn(s)
            except KvtraceError:
                v = None  # a table this database lacks (older schema): the cell stays empty
            values.append(None if isinstance(v, float) and not math.isfinite(v) else v)
        rows.append((name, unit, *values))
    return columns, rows


# ---- figures ---------------------------------------------------------------------------------------------

def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def fig_access_pattern(series: list[Series]):
    """Block id x time of one layer's KV reads and writes (paper Fig. 6), one panel per session."""
    shown = series[:4]
    fig = _figure(7.0, 2.6 * len(shown) + 0.6)
    axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
    for ax, s in zip(axes, shown):
        rows = s.q("access_pattern")
        if not rows:
            _empty(ax, f"{s.label}: no kv_access block records")
            continue
        step = max(1, len(rows) // ACCESS_POINTS)
        rows = rows[::step]
        for op, color, marker in (("write", "tab:red", "s"), ("read", "tab:blue", ".")):
            pts = [(r["t_ms"], r["block_id"]) for r in rows if r["op"] == op]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, c=color, marker=marker,
                           label=f"{op}s", rasterized=True, linewidths=0)
        ax.set_title(f"{s.label}: layer {rows[0]['layer']}" + (f" (1 in {step} records)" if step > 1 else ""),
                     fontsize=9)
        ax.set_xlabel("time since first step (ms)")
        ax.set_ylabel("block id")
        ax.legend(loc="upper left", fontsize=8, markerscale=3)
    return fig


def fig_kv_utilization(series: list[Series]):
    """Device KV usage % over time and, with a connector, the external tier's stored bytes (Fig. 11)."""
    fig = _figure()
    ax = fig.subplots()
    ext = None
    for s in series:
        rows = s.q("kv_utilization")
        (line,) = ax.step([r["t_s"] for r in rows], [r["usage_pct"] for r in rows], where="post",
                          label=f"{s.label} device")
        pre = [r for r in rows if r["num_preempted"]]
        if pre:
            ax.plot([r["t_s"] for r in pre], [r["usage_pct"] for r in pre], "x", color="k", ms=5)
        if any(r["ext_stored_bytes"] for r in rows):
            ext = ext or ax.twinx()
            # the session's own colour (the twin axis would start its colour cycle over)
            ext.plot([r["t_s"] for r in rows], [r["ext_stored_bytes"] / 2**20 for r in rows], "--",
                     color=line.get_color(), label=f"{s.label} external (MiB stored)")
    ax.set_xlabel("time since first step (s)")
    ax.set_ylabel("device KV blocks in use (%)")
    ax.set_ylim(0, 105)
    ax.set_title("KV cache utilization (x = preemption)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    if ext is not None:
        ext.set_ylabel("external tier stored (MiB)")
        ext.legend(loc="upper right", fontsize=8)
    return fig


def fig_step_time_fit(series: list[Series]):
    """Step duration vs forward tokens with the least-squares line of step_time_fit."""
    fig = _figure()
    ax = fig.subplots()
    for s in series:
        steps = [r for r in s.q("forward_pass_throughput") if r["step_ms"] is not None and r["tokens"]]
        pts = ax.scatter([r["tokens"] for r in steps], [r["step_ms"] for r in steps], s=6, alpha=0.5)
        fit = s.q("step_time_fit")
        if fit and fit[0]["slope_us_per_token"] is not None:
            f = fit[0]
            xs = [0, f["max_tokens"]]
            ax.plot(xs, [f["intercept_ms"] + f["slope_us_per_token"] / 1e3 * x for x in xs],
                    color=pts.get_facecolor()[0][:3],
                    label=f"{s.label}: {f['slope_us_per_token']:.1f} us/token + {f['intercept_ms']:.2f} ms, "
                          f"R2 {f['r2']:.2f}, n {f['n']}")
    ax.set_xlabel("forward tokens (scheduled tokens per step)")
    ax.set_ylabel("step duration (ms)")
    ax.set_title("Step time fit", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def fig_turn_latency(series: list[Series]):
    """Mean (and p90) latency by turn index for requests with a job/turn id."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure()
    ax = fig.subplots()
    drawn = False
    for s in series:
        rows = s.q("turn_latency")
        if rows:
            drawn = True
            line, = ax.plot([r["turn"] for r in rows], [r["latency_mean_ms"] for r in rows], "o-",
                            label=f"{s.label} mean")
            ax.plot([r["turn"] for r in rows], [r["latency_p90_ms"] for r in rows], ":", color=line.get_color(),
                    label=f"{s.label} p90")
    if not drawn:
        _empty(ax, "no requests with a job/turn id (record with --job-pattern)")
        return fig
    ax.set_xlabel("turn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("latency, arrival -> finish (ms)")
    ax.set_title("Per-turn latency", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def fig_admission_limits(series: list[Series]):
    """Share of steps by why admission stopped, grouped bars per session."""
    fig = _figure()
    ax = fig.subplots()
    reasons = sorted({r["reason"] for s in series for r in s.q("admission_limits")})
    width = 0.8 / max(len(series), 1)
    for i, s in enumerate(series):
        share = {r["reason"]: r["share"] for r in s.q("admission_limits")}
        ax.bar([j + i * width for j in range(len(reasons))], [share.get(r, 0.0) for r in reasons], width,
               label=s.label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(reasons))], reasons)
    ax.set_ylabel("share of steps")
    ax.set_title("Why admission stopped", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def fig_forward_pass_throughput(series: list[Series]):
    """Tokens/s per forward pass against batch size, by phase (paper Fig. 3)."""
    fig = _figure()
    ax = fig.subplots()
    markers = {"prefill-only": "^", "decode-only": "o", "mixed": "s"}
    for s in series:
        rows = [r for r in s.q("forward_pass_throughput") if r["tokens_per_s"] is not None]
        for phase, m in markers.items():
            pts = [r for r in rows if r["phase"] == phase]
            if pts:
                ax.scatter([r["batch_size"] for r in pts], [r["tokens_per_s"] for r in pts], s=10, marker=m,
                           alpha=0.6, label=f"{s.label} {phase}")
    ax.set_xlabel("batch size (requests in the step)")
    ax.set_ylabel("tokens/s (forward pass)")
    ax.set_title("Forward-pass throughput", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def fig_recompute_vs_swap(series: list[Series]):
    """Resume overhead per evicted-token bin: recompute vs connector load (paper Fig. 8b)."""
    fig = _figure()
    ax = fig.subplots()
    bins = sorted({r["evicted_bin"] for s in series for r in s.q("recompute_vs_swap", by="bin")})
    if not bins:
        _empty(ax, "no preemptions")
        return fig
    width = 0.8 / max(len(series), 1)
    for i, s in enumerate(series):
        by = {r["evicted_bin"]: r for r in s.q("recompute_vs_swap", by="bin")}
        xs = [j + i * width for j in range(len(bins))]
        rec = [by[b]["recompute_ms"] if b in by else 0.0 for b in bins]
        load = [by[b]["load_ms"] if b in by else 0.0 for b in bins]
        bars = ax.bar(xs, rec, width, label=f"{s.label}: recompute")
        if any(load):  # no legend entry for a connector that loaded nothing
            ax.bar(xs, load, width, bottom=rec, label=f"{s.label}: connector load",
                   color=bars.patches[0].get_facecolor(), hatch="//", alpha=0.6)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(bins))], [f">={b}" for b in bins])
    ax.set_xlim(-0.6, len(bins) - 0.2)  # one bin: a bar of its own width, not the whole axis
    ax.margins(y=0.3)  # room above the bars for the legend
    ax.set_xlabel("tokens thrown away per preemption (bin)")
    ax.set_ylabel("resume overhead (ms, summed)")
    ax.set_title("Recompute vs reload after preemption", fontsize=10)
    ax.legend(fontsize=7)
    return fig


DRAW = {name: globals()[f"fig_{name}"] for name in FIGURES}


def _save_figures(series: list[Series], out: Path) -> list[tuple[str, Path, Path]]:
    import matplotlib

    saved = []
    with matplotlib.rc_context(RC):
        for name in FIGURES:
            fig = DRAW[name](series)
            png, svg = out / f"{name}.png", out / f"{name}.svg"
            fig.savefig(png, dpi=110)
            fig.savefig(svg, metadata=SVG_META)
            saved.append((name, png, svg))
    return saved


# ---- HTML ------------------------------------------------------------------------------------------------

def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def _html(title: str, columns: list[str], rows: list[tuple], figures: list[tuple[str, Path, Path]],
          notes: list[str]) -> str:
    from kvtrace.queries import all_queries

    queries = all_queries()
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    figs = "".join(
        f'<figure id="{name}"><img src="{svg.name}" alt="{name}"><figcaption><b>{name}</b>: '
        f"{html.escape(queries[name].description if name in queries else '')} "
        f'(<a href="{png.name}">PNG</a>, <a href="{svg.name}">SVG</a>; '
        f"<code>kvtrace query DB {name}</code>)</figcaption></figure>"
        for name, png, svg in figures)
    note = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 2px 8px; text-align: right; }}
th:first-child, td:first-child, td:nth-child(2) {{ text-align: left; }}
figure {{ margin: 2em 0; }} img {{ max-width: 100%; }}
figcaption {{ font-size: 13px; color: #444; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<ul>{note}</ul>
<h2>Metrics</h2>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<h2>Figures</h2>
{figs}
</body></html>
"""


def _run(db_paths: Sequence[str | Path], out_dir: str | Path | None, title: str):
    series, cons = _series(db_paths)
    try:
        columns, rows = _table(series)
        written: list[Path] = []
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            figures = _save_figures(series, out)
            notes = [f"{s.label}: session {s.session} of {s.db}" for s in series]
            index = out / "index.html"
            index.write_text(_html(title, columns, rows, figures, notes), encoding="utf-8")
            written = [p for _, png, svg in figures for p in (png, svg)] + [index]
        return columns, rows, written
    finally:
        for con in cons:
            con.close()


def write_report(db_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write PNG and SVG figures and `index.html` for every session of `db_path` into `out_dir` (created).

    Figures: access pattern, KV utilization over time, step-time fit, per-turn latency, admission
    limits, forward-pass throughput, recompute vs reload. Sessions of one database are overlaid.
    Returns the paths written.
    """
    _, _, written = _run([db_path], out_dir, f"kvtrace report: {Path(db_path).name}")
    return written


def compare(db_paths: Sequence[str | Path], out_dir: str | Path | None = None) -> tuple[list[str], list[tuple]]:
    """Sessions side by side: (columns, rows) with columns metric, unit, then one per session.

    Every session of every database is a column (labelled by the database name when each holds one
    session, else by session id). With `out_dir`, also writes the overlaid figures and `index.html` there.
    """
    if not db_paths:
        raise KvtraceError("compare: give at least one database")
    columns, rows, _ = _run(db_paths, out_dir, "kvtrace compare: " + ", ".join(Path(p).name for p in db_paths))
    return columns, rows
