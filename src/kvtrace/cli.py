"""The `kvtrace` command line: a thin wrapper over the Python API, one function per command.

Errors a user can act on (`KvtraceError`) print as one line and exit 1; anything unexpected prints one
line and exits 2, with the traceback only under `--debug` (or KVTRACE_DEBUG=1).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import click

from kvtrace.errors import KvtraceError
from kvtrace.format.session import shown
from kvtrace.version import __version__

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _parse_size(text: str | None) -> int:
    if not text:
        return 0
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().rstrip("b").rstrip("i")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, KeyError):
        raise KvtraceError(f"--max-size {text!r}: not a size (examples: 500M, 2G, 1000000)") from None


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="kvtrace")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def cli(debug: bool) -> None:
    """Record, ingest, query and view what vLLM does with its KV cache.

    \b
    kvtrace record -o run1 -- vllm serve ./model --block-size 32
    kvtrace ingest run1 -o run1.duckdb
    kvtrace query run1.duckdb summary
    kvtrace export run1.duckdb --format html -o run1.html
    kvtrace demo -o demo/
    """
    if debug:
        os.environ["KVTRACE_DEBUG"] = "1"


@cli.command(context_settings={**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-o", "--output", "out", default="kvtrace-session", show_default=True,
              help="Session directory to write.")
@click.option("--max-size", default=None, help="Cap on the session's size on disk (e.g. 2G).")
@click.option("--on-max-size", type=click.Choice(["stop", "drop-oldest"]), default="stop", show_default=True,
              help="At the cap: stop recording, or delete the oldest shards (losses are counted either way).")
@click.option("--kv-layers", default="", help="Layers to record per-block KV reads/writes for: '0,15,31' or "
              "'all' (the layers of a KV-cache group read the same blocks: recorded once and copied at ingest; "
              "a busy GPU can still outrun the ring: the losses are counted; --kv-sample-every N keeps whole "
              "steps instead).")
@click.option("--kv-granularity", type=click.Choice(["off", "timing", "blocks"]), default="timing",
              show_default=True, help="Device/CPU KV access recording: off, per-layer timing (+ one layer's "
              "block lists per step), or full block records for --kv-layers.")
@click.option("--kv-sample-every", default=1, show_default=True, help="Record KV accesses every N-th step.")
@click.option("--kv-ring-capacity", default=1 << 20, show_default=True,
              help="KV access records a worker's ring holds between drains (a power of two); records "
              "overwritten before a drain are counted as dropped.")
@click.option("--job-pattern", default=None,
              help=r"Regex with named groups job and turn parsed from request ids, e.g. '(?P<job>\w+)-t(?P<turn>\d+)'.")
@click.option("--nvtx/--no-nvtx", default=True, show_default=True, help="Emit NVTX ranges and marks.")
@click.option("--nvtx-layers", is_flag=True, help="Also emit an NVTX range per attention layer.")
# The recorder's FLUSH_INTERVAL_S, written out: importing the recorder here would load pyarrow for every
# command (tests/unit/test_cli.py checks that the two agree).
@click.option("--flush-interval", default=2.0, show_default=True,
              help="Seconds between shard flushes (a process killed outright loses at most this much).")
@click.option("--probes", default=None, help="Comma-separated probes to enable (default: all).")
@click.option("--record-tokens", is_flag=True, help="Also record token ids (off by default: traces carry no prompt data).")
@click.option("--options-json", default=None, hidden=True,
              help="Extra recorder/probe options as a JSON object (tests and experts).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def record(out, max_size, on_max_size, kv_layers, kv_granularity, kv_sample_every, kv_ring_capacity, job_pattern,
           nvtx, nvtx_layers, flush_interval, probes, record_tokens, options_json, command) -> None:
    """Run COMMAND unchanged and record every vLLM process it starts.

    \b
    kvtrace record -o run1 -- vllm serve ./model --block-size 32
    kvtrace record -o run2 -- python my_script.py
    """
    from kvtrace.record.launch import run_recorded

    if kv_ring_capacity < 2 or kv_ring_capacity & (kv_ring_capacity - 1):
        raise KvtraceError(f"--kv-ring-capacity {kv_ring_capacity}: not a power of two >= 2")
    options = {
        "max_size_bytes": _parse_size(max_size), "max_size_policy": on_max_size,
        "kv_layers": kv_layers, "kv_granularity": kv_granularity, "kv_sample_every": kv_sample_every,
        "kv_ring_capacity": kv_ring_capacity,
        "job_pattern": job_pattern, "nvtx": nvtx, "nvtx_layers": nvtx_layers,
        "flush_interval_s": flush_interval, "record_tokens": record_tokens,
    }
    if probes:
        options["probes"] = [p.strip() for p in probes.split(",") if p.strip()]
    if options_json:
        try:
            extra = json.loads(options_json)
        except (ValueError, RecursionError) as exc:
            raise KvtraceError(f"--options-json: not JSON ({str(exc)[:200]})") from None
        if not isinstance(extra, dict):
            raise KvtraceError("--options-json: expected a JSON object")
        options.update(extra)
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    sys.exit(run_recorded(cmd, out, options))


@cli.command(context_settings=CONTEXT)
@click.argument("sessions", nargs=-1, type=click.Path())
@click.option("-o", "--output", "db", required=True, help="DuckDB file to write (created or updated).")
@click.option("--nsys", "nsys", multiple=True, type=click.Path(), help="Nsight Systems SQLite export to load too.")
@click.option("--job-pattern", default=None, help="Override the session's job/turn regex for request ids.")
@click.option("--progress/--no-progress", default=None, help="Progress on stderr (default: when a terminal).")
def ingest(sessions, db, nsys, job_pattern, progress) -> None:
    """Load recorded sessions (and Nsight SQLite exports) into one DuckDB database.

    \b
    kvtrace ingest run1 -o run1.duckdb
    kvtrace ingest run1 --nsys report.sqlite -o run1.duckdb
    kvtrace ingest --nsys report.sqlite -o nsys.duckdb
    """
    # Set before kvtrace.ingest imports NumPy and pyarrow; a user's values stand. NumPy's OpenBLAS threads
    # spin after each call: ~0.3 s of CPU over a 10 M-event ingest on 2 cores, for linear algebra
    # ingest never does. pyarrow's buffers from glibc's allocator rather than its default (mimalloc):
    # 35 MB less peak memory and a little less CPU for the same ingest (docs/performance.md).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    from kvtrace.ingest import ingest as do_ingest
    from kvtrace.ingest.arrow_setup import settle_pyarrow_without_pandas

    settle_pyarrow_without_pandas()  # this command never uses pandas: spare its import (~0.45 CPU-s)

    if not sessions and not nsys:
        raise KvtraceError("nothing to ingest: give a session directory and/or --nsys FILE")
    show = sys.stderr.isatty() if progress is None else progress

    def show_report(report: dict) -> None:  # each as it is made: a long list of sessions shows its progress
        if "nsys" in report:
            click.echo(f"nsys {report['nsys']}: " + ", ".join(
                f"{k} {v}" for k, v in report.items() if k not in ("nsys",) and not isinstance(v, dict)))
            return
        click.echo(f"session {report['session']} ({report['status']}): {report['events']:,} events in "
                   f"{report['seconds']:.2f} s ({report['events_per_s']:,.0f}/s) -> {db}")
        for problem in report["issues"]:
            click.echo(f"  incomplete: {problem}")
        for problem in report["problems"]:  # probes not attached, rows lost, probes that recorded nothing
            click.echo(f"  {problem}")

    t0 = time.monotonic()
    reports = do_ingest(list(sessions), db, nsys=list(nsys), progress=show, job_pattern=job_pattern,
                        on_report=show_report)
    seconds = time.monotonic() - t0
    if len(sessions) > 1:  # the sessions' own seconds leave out the database's opening and last checkpoint
        events = sum(r.get("events", 0) for r in reports if "nsys" not in r)
        click.echo(f"{len(sessions)} sessions: {events:,} events in {seconds:.2f} s "
                   f"({events / seconds if seconds > 0 else 0:,.0f}/s), all of it -> {db}")


def _print_rows(columns: list[str], rows: list[tuple], fmt: str) -> None:
    _print_chunks(columns, iter([rows]), fmt)


def _print_chunks(columns: list[str], chunks: Iterator[list[tuple]], fmt: str) -> int:
    """Write rows that come in chunks: csv and json as they come (a result of millions of rows is never
    held whole); a table needs every row first, for its column widths. Returns the rows written."""
    n = 0

    def counted(chunks):
        nonlocal n
        for chunk in chunks:
            n += len(chunk)
            yield chunk

    chunks = counted(chunks)
    if fmt == "json":  # exactly json.dumps(list of row objects, indent=1), one object at a time
        out = sys.stdout
        encode = json.JSONEncoder(default=str, indent=1).encode  # json.dumps would make one per row
        first = True
        for chunk in chunks:
            if not chunk:
                continue
            texts = [encode(dict(zip(columns, r, strict=False))).replace("\n", "\n ") for r in chunk]
            out.write(("[\n " if first else ",\n ") + ",\n ".join(texts))
            first = False
        out.write("[]\n" if first else "\n]\n")
    elif fmt == "csv":
        import csv

        w = csv.writer(sys.stdout)
        w.writerow(columns)
        for chunk in chunks:
            w.writerows(chunk)
    else:
        # Cells are made text once, column by column; lines go out a block at a time (click.echo per
        # line cost ~20 us, most of the time for a result of 100k rows).
        rows = [row for chunk in chunks for row in chunk]
        widths = [len(str(c)) for c in columns]
        for i, col in enumerate(zip(*rows, strict=False)):
            widths[i] = max(widths[i], max(map(len, map(_cell, col))))
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(columns, widths, strict=False)))
        click.echo("  ".join("-" * w for w in widths))
        block = 10_000
        for start in range(0, len(rows), block):
            cols = zip(*rows[start:start + block], strict=False)
            padded = [[text.ljust(w) for text in map(_cell, col)] for col, w in zip(cols, widths, strict=False)]
            click.echo("\n".join(map("  ".join, zip(*padded))))
    return n


# Control characters from the data (an ESC sequence in a request id) are shown, not sent to the terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    text = "" if v is None else str(v)
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text) if _CONTROL.search(text) else text


@cli.command(context_settings=CONTEXT)
@click.argument("db", required=False, type=click.Path())
@click.argument("name", required=False)
@click.option("--sql", default=None, help="Run this SQL instead of a canned query.")
@click.option("-p", "--param", "params", multiple=True, help="Query parameter NAME=VALUE (repeatable).")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--list", "list_", is_flag=True, help="List the canned queries.")
@click.option("--dataset", default=None, type=click.Path(), help="Query a Parquet dataset directory instead of DB.")
def query(db, name, sql, params, fmt, list_, dataset) -> None:
    """Run a canned query by name, or any SQL, on a kvtrace database.

    \b
    kvtrace query --list
    kvtrace query run1.duckdb summary --format json
    kvtrace query run1.duckdb prefix_hits -p session=20261122T120000-abcd1234
    kvtrace query run1.duckdb --sql "select * from steps order by step limit 5"
    kvtrace query --dataset sessions/ summary
    """
    from kvtrace.queries import all_queries, get_query, iter_sql

    if list_:
        for q in all_queries().values():
            click.echo(f"{q.name:28s} {q.description}")
        return
    if dataset is not None and db is not None and name is None:
        db, name = None, db  # `kvtrace query --dataset DIR NAME`
    values = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep:
            raise KvtraceError(f"--param {p!r}: expected NAME=VALUE")
        # A session id is text even when it looks like a number (`-p session=12345`).
        values[key.strip()] = value if key.strip() == "session" else _coerce(value)
    if dataset is not None:
        from kvtrace.export.dataset import open_dataset

        con = open_dataset(dataset)
    elif db is None:
        raise KvtraceError("give a database (kvtrace query DB NAME) or --dataset DIR or --list")
    else:
        from kvtrace.store.db import open_db

        con = open_db(db, read_only=True)
    try:
        if sql:
            columns, chunks = iter_sql(con, sql, values)
        elif name:
            q = get_query(name)
            columns, chunks = iter_sql(con, q.sql, values, q.params)
        else:
            raise KvtraceError("give a canned query name or --sql (kvtrace query --list shows the names)")
        if _print_chunks(columns, chunks, fmt) == 0 and name and not sql:  # on stderr: stdout stays data
            why = q.empty or "nothing in the database matches"
            sys.stdout.flush()  # the (empty) result first, then the note, also on one terminal
            click.echo(f"kvtrace: {name}: no rows: {why}", err=True)
    except KvtraceError as exc:
        if str(exc).startswith("query failed"):  # DuckDB's reason: say which database it was about
            raise KvtraceError(f"{dataset if dataset is not None else db}: {exc}") from None
        raise
    finally:
        con.close()


def _coerce(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


@cli.command(context_settings=CONTEXT)
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["html", "perfetto", "parquet"]), default=None,
              help="Output format (default: from -o: .html, .json, or a name without extension for parquet).")
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="File (html, perfetto) or directory (parquet).")
@click.option("--session", default=None, help="Session id to export when the database holds several.")
@click.option("--max-events", default=1_000_000, show_default=True, help="HTML viewer: aggregate or sample past this.")
def export(sources, fmt, out, session, max_events) -> None:
    """Write a static HTML viewer, Perfetto/Chrome trace JSON, or a Parquet dataset.

    \b
    kvtrace export run1.duckdb --format html -o run1.html
    kvtrace export run1.duckdb --format perfetto -o run1.json
    kvtrace export run1.duckdb run2.duckdb --format parquet -o dataset/
    kvtrace export session_dir1 session_dir2 --format parquet -o dataset/
    """
    if fmt is None:
        suffix = Path(out).suffix.lower()
        fmt = {".html": "html", ".json": "perfetto", "": "parquet"}.get(suffix)
        if fmt is None:  # e.g. out.txt: a file name that is none of ours, not a dataset folder
            raise KvtraceError(f"-o {out}: cannot tell the format from the name; give --format "
                               "(html, perfetto, parquet), a .html or .json file, or a folder for parquet")
    if fmt == "parquet":
        from kvtrace.export.dataset import export_parquet

        report = export_parquet(list(sources), out)
        click.echo(f"wrote {report['sessions']} session(s), {report['files']} files, "
                   f"{report['bytes']:,} bytes -> {out}")
        return
    if len(sources) != 1:
        raise KvtraceError(f"--format {fmt} takes one database")
    if fmt == "html":
        from kvtrace.export.viewer import export_html

        info = export_html(sources[0], out, session=session, max_events=max_events)
    else:
        from kvtrace.export.perfetto import export_perfetto

        info = export_perfetto(sources[0], out, session=session)
    click.echo(f"wrote {out}" + (f" ({info})" if info else ""))


@cli.command(context_settings=CONTEXT)
@click.argument("db", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Directory for figures and index.html.")
def report(db, out) -> None:
    """Draw the main analyses (PNG and SVG) with an index page.

    \b
    kvtrace report run1.duckdb -o report/
    """
    from kvtrace.export.report import write_report

    paths = write_report(db, out)
    click.echo(f"wrote {len(paths)} files -> {out}")


@cli.command(context_settings=CONTEXT)
@click.argument("dbs", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", "out", default=None, type=click.Path(), help="Also write overlaid figures here.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
def compare(dbs, out, fmt) -> None:
    """Put sessions side by side: the same analyses per session in one table (and overlaid figures).

    \b
    kvtrace compare fcfs.duckdb pinning.duckdb offload.duckdb -o compare/
    """
    from kvtrace.export.report import compare as do_compare

    columns, rows = do_compare(list(dbs), out_dir=out)
    _print_rows(columns, rows, fmt)


@cli.command(context_settings=CONTEXT)
@click.argument("session", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Session directory to write.")
@click.option("--num-blocks", type=int, default=None, help="KV blocks in the pool (vLLM's num_gpu_blocks).")
@click.option("--block-size", type=int, default=None, help="Tokens per KV block.")
@click.option("--max-num-seqs", type=int, default=None, help="Requests running at once.")
@click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget of a step.")
@click.option("--max-model-len", type=int, default=None, help="Longest sequence (tokens).")
@click.option("--prefix-caching/--no-prefix-caching", default=None, help="Automatic prefix caching on or off.")
@click.option("--cpu-offload-gib", type=float, default=None,
              help="A CPU offload tier of this many GiB (vLLM's SimpleCPUOffloadConnector; copies finish within "
                   "the step that starts them).")
@click.option("--scheduler-cls", default=None, help="module.Class of a vLLM Scheduler subclass to replay with "
              "(a policy, e.g. TTL pinning; importable here, e.g. with PYTHONPATH).")
@click.option("--sweep", default=None, help="SETTING=V1,V2,...: one replay per value into -o (a folder), "
                                            "with sweep.duckdb, a Parquet dataset, sweep.csv and a figure.")
@click.option("--clock", type=click.Choice(["steps", "timed"]), default="steps", show_default=True,
              help="steps: each request queued before the step it was in the recording (fast, exact at the "
                   "recording's configuration); timed: arrivals at their recorded times and step times from "
                   "a fit on the recording (runs as long as the run it predicts).")
@click.option("--progress/--no-progress", default=None, help="Progress on stderr (default: when a terminal).")
def replay(session, out, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
           prefix_caching, cpu_offload_gib, scheduler_cls, sweep, clock, progress) -> None:
    """Run a recording's requests again through vLLM's own scheduler and KV cache manager (no model, CPU),
    at its configuration or another, recorded as a new session. Settings not given are the recording's.

    \b
    kvtrace replay run1 -o run1-64 --num-blocks 64
    kvtrace ingest run1 run1-64 -o both.duckdb && kvtrace query both.duckdb summary
    kvtrace replay run1 --sweep num-blocks=34,40,64,128 -o sweep/
    kvtrace replay run1 -o run1-pinned --scheduler-cls my_policies.PinningScheduler
    kvtrace replay run1 -o run1-offload --num-blocks 34 --cpu-offload-gib 0.05
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's config messages are not this command's output
    from kvtrace.replay import replay as do_replay

    overrides = {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": max_num_seqs,
                 "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
                 "enable_prefix_caching": prefix_caching, "scheduler_cls": scheduler_cls,
                 "cpu_offload_bytes": None if cpu_offload_gib is None else int(cpu_offload_gib * (1 << 30))}
    if cpu_offload_gib is not None and not 0 < cpu_offload_gib <= 1 << 20:
        raise KvtraceError(f"--cpu-offload-gib {cpu_offload_gib}: a size in GiB above 0")
    show = sys.stderr.isatty() if progress is None else progress
    if sweep is not None:
        if clock != "steps":
            raise KvtraceError("--sweep replays with --clock steps (a timed sweep would take each run's time)")
        from kvtrace.replay.sweep import COLUMNS
        from kvtrace.replay.sweep import sweep as do_sweep

        res = do_sweep(session, out, sweep, overrides, progress=show)
        _print_rows([res["setting"], *COLUMNS[1:]], res["rows"], "table")
        click.echo(f"sessions, {Path(res['db']).name}, dataset/, sweep.csv, sweep.png -> {out}")
        return
    r = do_replay(session, out, overrides, progress=show, clock=clock)
    click.echo(f"replayed {r['requests']:,} requests of {session} in {r['steps']:,} engine steps "
               f"(clock {clock}) -> {r['session_dir']}")
    for rid, why in list(r["skipped"].items())[:5]:
        click.echo(f"  not replayed: {rid}: {why}")
    if len(r["skipped"]) > 5:
        click.echo(f"  ... and {len(r['skipped']) - 5} more not replayed")


@cli.command(context_settings=CONTEXT)
@click.option("-o", "--output", "out", default="kvtrace-demo", show_default=True, help="Directory for everything.")
@click.option("--requests", "num_requests", default=24, show_default=True, help="Requests in the workload.")
def demo(out, num_requests) -> None:
    """Make a tiny local model, record a vLLM run with prefix sharing and preemptions, ingest, query, view.

    \b
    kvtrace demo -o demo/
    """
    from kvtrace.demo import run_demo

    run_demo(Path(out), num_requests=num_requests)


@cli.command(context_settings=CONTEXT)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--source", default=None, type=click.Path(exists=True),
              help="Check another vLLM release's source instead of the installed one: a wheel, a folder "
              "holding vllm/, or a skeleton .json (it is not imported).")
def doctor(fmt, source) -> None:
    """Say what kvtrace will record with the vLLM installed here, without starting an engine: per probe
    and hook, attached, degraded (what is lost) or missing. Exits 1 when a probe cannot attach.

    \b
    kvtrace doctor
    kvtrace doctor --format json
    kvtrace doctor --source vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    """
    from kvtrace.probes.vllm.doctor import check, verdict_line

    report = check(source)
    if fmt == "json":
        click.echo(json.dumps(report, indent=1))
    else:
        click.echo(verdict_line(report))
        for probe in report["probes"]:
            for hook in probe["hooks"]:
                detail = f"  {hook['detail']}" if hook["detail"] else ""
                click.echo(f"  {probe['probe']:<13} {hook['hook']:<58} {hook['status']}{detail}")
            if "detail" in probe:
                click.echo(f"  {probe['probe']:<13} {probe['status']}: {probe['detail']}")
    sys.exit(0 if report["ok"] else 1)


@cli.command("make-model", context_settings=CONTEXT)
@click.option("-o", "--output", "out", default=None, help="Directory (default: a folder in ~/.cache/kvtrace, or $KVTRACE_CACHE).")
def make_model(out) -> None:
    """Create the tiny random-weight Llama and tokenizer used by the demo and tests (offline).

    \b
    kvtrace make-model
    """
    from kvtrace.demo.model import ensure_tiny_model

    click.echo(str(ensure_tiny_model(out)))


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="kvtrace", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("kvtrace: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KvtraceError as exc:
        click.echo(f"kvtrace: error: {exc}", err=True)
        if os.environ.get("KVTRACE_DEBUG"):
            traceback.print_exc()
        sys.exit(1)
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(130)
    except OSError as exc:  # the machine said no (a read-only place, a full disk, a file in the way): one line
        where = exc.filename if exc.filename is not None else ""
        what = exc.strerror or str(exc)
        click.echo(f"kvtrace: error: {shown(os.fsdecode(where)) + ': ' if where != '' else ''}{what}", err=True)
        if os.environ.get("KVTRACE_DEBUG"):
            traceback.print_exc()
        sys.exit(1)
    except Exception as exc:
        import duckdb

        # A database file that cannot be read whole (cut, damaged): DuckDB's message names the file.
        damaged = isinstance(exc, (duckdb.IOException, duckdb.SerializationException))
        first = (str(exc).splitlines() or [""])[0][:300]
        if damaged:
            click.echo(f"kvtrace: error: {first}", err=True)
        else:  # a bug of ours: still one line unless asked for more
            click.echo(f"kvtrace: internal error: {exc.__class__.__name__}: {first} (rerun with --debug for a "
                       "traceback)", err=True)
        if os.environ.get("KVTRACE_DEBUG"):
            traceback.print_exc()
        sys.exit(1 if damaged else 2)
