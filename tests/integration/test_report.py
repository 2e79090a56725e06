"""kvtrace.export.report: figures and the static page for one database, and sessions side by side.

On the standard recorded run (conftest's `recorded_run`) and a copy of it: the files exist and are what
their names say (PNG, well-formed SVG, a page that loads nothing from the network), and the numbers in
the comparison table are the canned queries' numbers and vLLM's own counters.
"""

from __future__ import annotations

import re
import shutil
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

import duckdb
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.export.report import FIGURES, compare, write_report


@pytest.fixture(scope="module")
def report(recorded_run, tmp_path_factory) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("report") / "rep"
    return out, write_report(recorded_run["db"], out)


def test_write_report_files(report):
    out, written = report
    assert sorted(written) == sorted([out / f"{n}.{ext}" for n in FIGURES for ext in ("png", "svg")]
                                     + [out / "index.html"])
    for name in FIGURES:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        root = ET.parse(out / f"{name}.svg").getroot()
        assert root.tag.endswith("svg")
    page = (out / "index.html").read_text()
    # Static and offline: every image and link is a file next to the page; no URL with a scheme.
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all((out / r).is_file() for r in refs), refs
    assert not re.search(r'(?:src|href)="[a-z]+:', page) and "<script" not in page
    for name in ("access_pattern", "kv_utilization", "step_time_fit", "turn_latency", "admission_limits"):
        assert f'src="{name}.svg"' in page


def test_report_figures_carry_the_data(report, recorded_run):
    out, _ = report
    svg = (out / "step_time_fit.svg").read_text()
    with duckdb.connect(str(recorded_run["db"]), read_only=True) as con:
        from kvtrace.queries import run_query

        cols, rows = run_query(con, "step_time_fit")
        fit = dict(zip(cols, rows[0]))
        sid = fit["session"]
    # Text is kept as text in the SVG (searchable): the legend states the fit.
    assert f"{fit['slope_us_per_token']:.1f} us/token" in svg and sid in svg
    assert "layer 0" in (out / "access_pattern.svg").read_text()


def test_report_is_deterministic(report, recorded_run, tmp_path):
    out, _ = report
    again = write_report(recorded_run["db"], tmp_path / "again")
    for path in again:
        if path.suffix in (".svg", ".html"):
            assert path.read_bytes() == (out / path.name).read_bytes(), path.name


def test_compare_one_database_matches_the_queries(recorded_run):
    from kvtrace.queries import run_query

    columns, rows = compare([recorded_run["db"]])
    with duckdb.connect(str(recorded_run["db"]), read_only=True) as con:
        sid = con.execute("select session from sessions").fetchall()[0][0]
        cols, fit = run_query(con, "step_time_fit")
        fit = dict(zip(cols, fit[0]))
        cols, adm = run_query(con, "admission_limits")
        adm = {r[cols.index("reason")]: r[cols.index("share")] for r in adm}
    assert columns == ["metric", "unit", sid]
    table = {r[0]: r[2] for r in rows}
    vllm = recorded_run["metrics"]["vllm"]
    assert table["preemptions"] == vllm["num_preemptions"]
    assert table["prefix hit rate (local)"] == pytest.approx(vllm["prefix_cache_hits"] / vllm["prefix_cache_queries"])
    assert table["requests finished"] == 18
    with duckdb.connect(str(recorded_run["db"]), read_only=True) as con:
        cols, lives = run_query(con, "block_lifetimes")
    idle = sorted(r[cols.index("idle_before_end_ms")] for r in lives if r[cols.index("end_event")] == "evict")
    assert idle, "the standard workload evicts cached blocks"
    assert table["median idle before eviction"] == pytest.approx(statistics.median(idle), rel=1e-9)
    assert table["step-time fit: slope"] == pytest.approx(fit["slope_us_per_token"], rel=1e-6)
    assert table["step-time fit: R2"] == pytest.approx(fit["r2"], rel=1e-6)
    assert table["admission stopped by kv-insuf"] == pytest.approx(adm.get("kv-insuf", 0.0), rel=1e-6)
    assert table["pins and holds"] == 0 and table["pins reused before they ended"] is None


def test_compare_counts_finished_requests_without_job_ids(recorded_run, tmp_path):
    """A serving run has no job/turn ids: its finished requests are counted all the same."""
    db = tmp_path / "no-jobs.duckdb"
    shutil.copy(recorded_run["db"], db)
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE requests SET job_id = NULL, turn = NULL")
    _, rows = compare([db])
    table = {r[0]: r[2] for r in rows}
    assert table["requests finished"] == 18
    assert table["mean turn latency"] is None  # needs job ids: blank, not 0


def test_compare_side_by_side_with_figures(recorded_run, tmp_path):
    a, b = tmp_path / "first.duckdb", tmp_path / "second.duckdb"
    shutil.copy(recorded_run["db"], a)
    shutil.copy(recorded_run["db"], b)
    columns, rows = compare([a, b], tmp_path / "cmp")
    assert columns == ["metric", "unit", "first", "second"]
    assert all(r[2] == r[3] for r in rows), [r for r in rows if r[2] != r[3]]  # the same session twice
    svg = (tmp_path / "cmp" / "kv_utilization.svg").read_text()
    assert "first device" in svg and "second device" in svg  # overlaid, one line per session
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert "<th>first</th><th>second</th>" in page
    # The same database twice: columns are told apart by database name.
    columns, _ = compare([a, a])
    assert columns[2] != columns[3] and all(c.startswith("first") for c in columns[2:])


def test_report_errors(tmp_path):
    from kvtrace.store.layout import create_tables

    empty = tmp_path / "empty.duckdb"
    with duckdb.connect(str(empty)) as con:
        create_tables(con)
    with pytest.raises(KvtraceError, match="no sessions"):
        write_report(empty, tmp_path / "out")
    with pytest.raises(KvtraceError, match="no such database"):
        compare([tmp_path / "missing.duckdb"])
    with pytest.raises(KvtraceError):
        compare([])
