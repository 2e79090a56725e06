"""How big and how fast the HTML viewer is for a 1 M-event session.

    python bench/bench_viewer.py                      # 1,000,000 events, kvtrace.testing.synth when present
    python bench/bench_viewer.py --generator sql      # rows INSERTed with DuckDB range() instead
    python bench/bench_viewer.py --events 200000 --check

Makes the session database (kvtrace.testing.synth shards + ingest, or SQL straight into the schema), exports
the viewer (`kvtrace.export.viewer.export_html`, default --max-events), and opens it from disk in headless
Chromium (Debian's chromium via Python playwright). Prints the export time, the file size and the time
to the first view: from navigation start to the end of the viewer's first draw (the page's
`performance.now()` when it is ready), and the wall time of the whole load seen from Python. Then each
other view's first draw. Limits: 25 MB and 3 s (`--check` exits 1 when one is exceeded).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MAX_MB, MAX_FIRST_VIEW_S = 25.0, 3.0
EVENT_TABLES = ("steps", "step_requests", "request_events", "block_events", "prefix_lookups", "preemptions",
                "pins", "transfers", "batch_slots", "kv_access", "layer_timings", "clock_anchors", "drops")


def make_synth(events: int, work: Path) -> Path:
    """kvtrace.testing.synth's shards (the real shard format), ingested like a recording."""
    session, db = work / "synth", work / "synth.duckdb"
    subprocess.run([sys.executable, "-m", "kvtrace.testing.synth", "-o", str(session), "--events", str(events),
                    "--seed", "1"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "kvtrace", "ingest", str(session), "-o", str(db)], check=True,
                   capture_output=True)
    return db


def make_sql(events: int, work: Path) -> Path:
    """Rows INSERTed straight into the ingest schema with range(): 32 lanes of requests of 200 steps,
    4 layers of kv_access (one write and several reads per layer per running request) filling the rest."""
    from kvtrace.store.keyed import insert_select
    from kvtrace.store.layout import create_tables

    db = work / "sql.duckdb"
    con = duckdb.connect(str(db))
    create_tables(con)
    n_steps, lanes, life = max(100, events // 320), 32, 200
    t0 = 10**12
    con.execute("""INSERT INTO sessions (session, status, start_monotonic_ns, start_utc_ns, block_size, num_kv_blocks,
        max_num_seqs, max_num_batched_tokens, model, vllm_version, job_pattern)
        VALUES ('bench', 'complete', ?, 0, 16, 4096, 32, 8192, 'bench-sql', '0.32.0', 'job(?P<job>\\d+)-turn(?P<turn>\\d+)')""",
                [t0])
    # One step every 8 ms: schedule 0.3 ms, the rest executing.
    con.execute(f"""INSERT INTO steps SELECT 'bench', 0, 1, i + 1, {t0} + i * 8000000, {t0} + i * 8000000 + 300000,
        {t0} + i * 8000000 + 7900000, 64 + (i % 5) * 40, (i % 5) * 40, 64, (i % 5 > 0)::INT * 2, 30, 32, i % 3,
        1800 + (i * 37) % 1800, 4096, 8192, 32,
        CASE i % 7 WHEN 0 THEN 'kv-insuf' WHEN 3 THEN 'tok-budget' ELSE 'none' END, (i % 997 = 0)::INT,
        (i % 5 > 0)::INT, 0, (i % 6 = 0)::INT, 900, 640
        FROM range({n_steps}) t(i)""")
    # Lane l runs request k = (i + 7 l) // life at step i: prefill for its first 3 steps, then decode.
    req = f"'job' || l || '-turn' || ((i + 7 * l) // {life})"
    pos = f"((i + 7 * l) % {life})"
    insert_select(con, "step_requests", f"""SELECT 'bench', 0, 1, i + 1, {req}, CASE WHEN {pos} < 3 THEN 128 ELSE 1 END,
        CASE WHEN {pos} < 3 THEN 'prefill' ELSE 'decode' END, CASE WHEN {pos} < 3 THEN {pos} ELSE -1 END,
        {pos} * 16, ({pos} % 8 = 0)::INT, CASE WHEN {pos} = 0 THEN 'new' ELSE 'running' END
        FROM range({n_steps}) a(i), range({lanes}) b(l)""")
    ev = f"{t0} + i * 8000000"
    con.execute(f"""INSERT INTO request_events SELECT 'bench', 0, 1, {ev} + e * 1000, i + 1, {req},
        ['arrival', 'queued', 'scheduled', 'first_token', 'finished'][e + 1],
        CASE e WHEN 0 THEN 900 WHEN 2 THEN 640 ELSE 1 END, CASE e WHEN 4 THEN 'length' END
        FROM range({n_steps}) a(i), range({lanes}) b(l), range(5) c(e)
        WHERE ({pos} = 0 AND e < 3) OR ({pos} = 3 AND e = 3) OR ({pos} = {life - 1} AND e = 4)""")
    blk = f"l * 128 + ({pos} // 8) % 128"
    insert_select(con, "block_events", f"""SELECT 'bench', 0, 1, {ev} + 100000, i + 1,
        CASE WHEN {pos} = {life - 1} THEN 'free' ELSE 'alloc' END, 0, {req},
        CASE WHEN {pos} = {life - 1} THEN l * 128 + j ELSE {blk} END, NULL
        FROM range({n_steps}) a(i), range({lanes}) b(l), range({life // 8}) c(j)
        WHERE ({pos} % 8 = 0 AND j = 0) OR {pos} = {life - 1}""")
    con.execute(f"""INSERT INTO prefix_lookups SELECT 'bench', 0, 1, {ev}, i + 1, {req}, 900, 640, 40, 56, 4, [], NULL, 0
        FROM range({n_steps}) a(i), range({lanes}) b(l) WHERE {pos} = 0""")
    con.execute(f"""INSERT INTO preemptions SELECT 'bench', 0, 1, {ev} + 200000, i + 1, 'job3-turn' || ((i + 21) // {life}),
        512, 32, 40 FROM range({n_steps}) t(i) WHERE i % 997 = 0""")
    used = sum(con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in EVENT_TABLES)
    per = max(4, round((events - used) / (n_steps * lanes)))  # kv_access rows per (step, lane)
    insert_select(con, "kv_access", f"""SELECT 'bench', 0, 2, i + 1, j % 4, {ev} + 300000 + (j % 4) * 1000000,
        (j >= 4)::TINYINT, l, l * 128 + ((j // 4) % (1 + {pos} // 8)), 0, 16, {req}
        FROM range({n_steps}) a(i), range({lanes}) b(l), range({per}) c(j)""")
    con.execute("""INSERT INTO requests SELECT session, 0, request_id, regexp_extract(request_id, 'job(\\d+)', 1),
        TRY_CAST(regexp_extract(request_id, 'turn(\\d+)', 1) AS INTEGER),
        min(ts_ns) FILTER (event = 'arrival'), min(ts_ns) FILTER (event = 'queued'),
        min(ts_ns) FILTER (event = 'scheduled'), min(ts_ns) FILTER (event = 'first_token'),
        max(ts_ns) FILTER (event = 'finished'), any_value(reason) FILTER (event = 'finished'),
        900, 200, 640, 0, 0 FROM request_events GROUP BY ALL""")
    con.execute("CHECKPOINT")
    con.close()
    return db


def count_events(db: Path) -> dict[str, int]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {t: con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in EVENT_TABLES}
    finally:
        con.close()


def open_in_browser(html: Path) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    out: dict[str, float] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 950})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        t = time.monotonic()
        page.goto(html.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        out["load_wall_s"] = time.monotonic() - t
        out["first_view_s"] = page.evaluate("window.kvtraceViewer.renderedMs") / 1000
        for tab in ("requests", "blocks"):
            out[f"{tab}_view_s"] = page.evaluate(f"""() => {{
                const t = performance.now();
                document.querySelector(".tab[data-tab='{tab}']").click();
                return (performance.now() - t) / 1000; }}""")
        out["heat_states_s"] = page.evaluate("""() => {
            const t = performance.now();
            const r = document.querySelector("input[name='heat-mode'][value='state']");
            r.checked = true; r.dispatchEvent(new Event('change'));
            return (performance.now() - t) / 1000; }""")
        browser.close()
    if errors:
        raise SystemExit(f"console errors in the viewer: {errors[:3]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--generator", choices=["auto", "synth", "sql"], default="auto",
                    help="auto: kvtrace.testing.synth when it is installed, else sql")
    ap.add_argument("--max-events", type=int, default=1_000_000, help="export_html's budget (the CLI default)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--check", action="store_true", help=f"exit 1 past {MAX_MB:g} MB or {MAX_FIRST_VIEW_S:g} s")
    args = ap.parse_args(argv)
    gen = args.generator
    if gen == "auto":
        try:
            import kvtrace.testing.synth  # noqa: F401
            gen = "synth"
        except ImportError:
            gen = "sql"
    from kvtrace.export.viewer import export_html

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        t = time.monotonic()
        db = make_synth(args.events, work) if gen == "synth" else make_sql(args.events, work)
        made = time.monotonic() - t
        counts = count_events(db)
        total = sum(counts.values())
        print(f"session: {gen} generator, {total:,} events in the database ({made:.1f} s to make): "
              + ", ".join(f"{k} {v:,}" for k, v in counts.items() if v))
        html = work / "view.html"
        t = time.monotonic()
        summary = export_html(db, html, max_events=args.max_events)
        export_s = time.monotonic() - t
        size_mb = html.stat().st_size / 1e6
        print(f"export: {export_s:.2f} s ({summary})")
        print(f"size: {size_mb:.1f} MB (limit {MAX_MB:g} MB)")
        b = open_in_browser(html)
        print(f"first view: {b['first_view_s']:.2f} s from navigation start to first draw "
              f"(limit {MAX_FIRST_VIEW_S:g} s); page load seen from Python {b['load_wall_s']:.2f} s")
        print(f"other views, first draw: requests {b['requests_view_s']:.2f} s, KV blocks "
              f"{b['blocks_view_s']:.2f} s, block states {b['heat_states_s']:.2f} s")
    ok = size_mb < MAX_MB and b["first_view_s"] < MAX_FIRST_VIEW_S
    print("OK" if ok else "OVER A LIMIT")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
