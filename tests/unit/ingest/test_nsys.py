"""Nsight Systems exports: loading real exports of six nsys versions, bad input, alignment to our clock,
per-step attribution, and the canned nsys queries.

The real exports are in tests/data/nsys (copied from the project's shared fixtures; PROVENANCE.md). Exports with
known events are built from a real one: a copy keeps nsys's own CREATE TABLE statements, its event
tables are emptied, and rows are inserted from a real row of the same table with fields overridden.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import duckdb
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.ingest import nsys_read
from kvtrace.ingest.nsys import align_nsys, load_nsys
from kvtrace.queries import run_query
from kvtrace.store.nsys_tables import TABLES, create_nsys_tables

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "nsys"  # copies of ../shared/fixtures/nsys (PROVENANCE.md)
EXPORTS = sorted(FIXTURES.glob("*.sqlite")) if FIXTURES.is_dir() else []
pytestmark = pytest.mark.skipif(not EXPORTS, reason=f"no Nsight Systems fixtures in {FIXTURES}")

KERNEL, RUNTIME, MEMCPY, MEMSET = (f"CUPTI_ACTIVITY_KIND_{k}" for k in ("KERNEL", "RUNTIME", "MEMCPY", "MEMSET"))
NVTX = "NVTX_EVENTS"
OURS = {KERNEL: "nsys_kernels", RUNTIME: "nsys_runtime", MEMCPY: "nsys_memcpy", MEMSET: "nsys_memset",
        NVTX: "nsys_nvtx", "ThreadNames": "nsys_threads", "PROCESSES": "nsys_processes",
        "TARGET_INFO_GPU": "nsys_gpus"}
KNOWN_VERSIONS = {
    "cardiac__report1.sqlite": None,  # 2021: no metadata table
    "fuser__report1_2024-12.sqlite": "2024.6.2.25",
    "fuser__report1_2025-03.sqlite": "2025.1.1.110",
    "nsys-ai__h100_2gpu_1s.sqlite": "2026.2.1.210",
    "pipit__saxpy-mpi-cuda_nsys_perlmutter0.sqlite": "2022.2.1.31",
    "sc23__report3.sqlite": "2023.3.1.92",
}
ALIGN_BASE = "fuser__report1_2025-03.sqlite"  # has every event table the alignment export needs


def sqlite_count(path: Path, table: str) -> int:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    except sqlite3.OperationalError:
        return 0  # table not in this export
    finally:
        con.close()


@pytest.fixture(scope="module")
def loaded():
    """Every real export loaded into one database (alone, so session NULL)."""
    con = duckdb.connect()
    stats = {p.name: load_nsys(con, p) for p in EXPORTS}
    yield con, stats
    con.close()


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copyfile(FIXTURES / name, dst)  # copyfile: the fixtures are read-only, the copy must not be
    return dst


# -- real exports --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXPORTS, ids=[p.name for p in EXPORTS])
def test_row_counts_match_sqlite(loaded, path):
    con, stats = loaded
    for source, ours in OURS.items():
        got = con.execute(f"SELECT count(*) FROM {ours} WHERE nsys_file = ?", [path.name]).fetchone()[0]
        assert got == sqlite_count(path, source), (source, ours)
    assert stats[path.name]["reader"] == "adbc"


def test_versions(loaded):
    con, _stats = loaded
    versions = dict(con.execute("SELECT nsys_file, nsys_version FROM nsys_exports").fetchall())
    assert {name: versions.get(name, "?") for name in KNOWN_VERSIONS} == KNOWN_VERSIONS
    row = con.execute("SELECT utc_epoch_ns, system_clock_ns, alignment, session FROM nsys_exports "
                      "WHERE nsys_file = 'nsys-ai__h100_2gpu_1s.sqlite'").fetchone()
    assert row == (1779630014975716426, 35255823190, "none", None)


def test_decoded_values(loaded):
    con, _stats = loaded
    pipit = "pipit__saxpy-mpi-cuda_nsys_perlmutter0.sqlite"
    kernel = con.execute("SELECT name, demangled_name, pid, launch_name, launch_tid FROM nsys_kernels "
                         "WHERE nsys_file = ? AND start_ns = 924922186", [pipit]).fetchone()
    # globalTid 302119224788637 = (1 << 48) | (1230493 << 24) | 1230493
    assert kernel == ("saxpy", "saxpy(double *, double *, double *, double, int)", 1230493,
                      "cudaLaunchKernel_v7000", 1230493)  # not its "CUDA backtrace" twin, cudaLaunchKernel
    nvtx = con.execute("SELECT label, domain, kind, pid, tid FROM nsys_nvtx WHERE nsys_file = ? "
                       "AND start_ns = 65117824", [pipit]).fetchone()
    assert nvtx == ("MPI_Init", "MPI", "push_pop", 1230493, 1230493)  # label via textId -> StringIds
    assert con.execute("SELECT name FROM nsys_threads WHERE nsys_file = ? AND tid = 1230493",
                       [pipit]).fetchone() == ("MPI Rank 0",)
    copies = con.execute("SELECT copy_kind, src_kind, dst_kind, count(*), sum(bytes) FROM nsys_memcpy "
                         "WHERE nsys_file = ? GROUP BY ALL ORDER BY 1", [pipit]).fetchall()
    assert copies == [("DtoH", "Device", "Pageable", 5, 1310720000), ("HtoD", "Pageable", "Device", 10, 2621440000)]
    gpu = con.execute("SELECT name, sm_count, compute_capability, total_memory_bytes FROM nsys_gpus "
                      "WHERE nsys_file = 'sc23__report3.sqlite'").fetchone()
    assert gpu == ("Tesla T4", 40, "7.5", 15843721216)
    two_gpus = con.execute("SELECT DISTINCT device_id, pid FROM nsys_kernels WHERE nsys_file = "
                           "'nsys-ai__h100_2gpu_1s.sqlite' ORDER BY 1").fetchall()
    assert two_gpus == [(0, 111), (1, 112)]  # one process per GPU


def test_no_environment_copied(loaded):
    con, _stats = loaded
    for table in TABLES:
        for (col,) in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = ? "
                                  "AND data_type = 'VARCHAR'", [table]).fetchall():
            hits = con.execute(f"SELECT count(*) FROM {table} WHERE {col} LIKE '%PATH=%' OR {col} LIKE '%HOME=/%' "
                               f"OR {col} LIKE '%REDACTED%'").fetchone()[0]
            assert hits == 0, (table, col)


def test_reload_replaces_and_sessions_are_separate(tmp_path):
    path = EXPORTS[0].parent / "pipit__saxpy-mpi-cuda_nsys_perlmutter0.sqlite"
    con = duckdb.connect()
    load_nsys(con, path)
    load_nsys(con, path)
    load_nsys(con, path, session="s1")
    counts = con.execute("SELECT session, count(*) FROM nsys_kernels GROUP BY ALL ORDER BY 1").fetchall()
    assert counts == [("s1", 5), (None, 5)]
    assert con.execute("SELECT count(*) FROM nsys_exports").fetchone()[0] == 2


def test_missing_table_and_extra_column(tmp_path):
    path = copy_fixture("sc23__report3.sqlite", tmp_path)
    with sqlite3.connect(path) as db:
        db.execute(f"DROP TABLE {MEMCPY}")
        db.execute(f"ALTER TABLE {KERNEL} ADD COLUMN userNote TEXT")
        db.execute(f"UPDATE {KERNEL} SET userNote = 'x' || rowid")
        db.execute(f"ALTER TABLE {RUNTIME} DROP COLUMN returnValue")  # an optional column gone
    con = duckdb.connect()
    stats = load_nsys(con, path)
    assert stats["rows"]["nsys_kernels"] == 50 and "nsys_memcpy" not in stats["rows"]
    assert con.execute("SELECT count(*) FROM nsys_runtime WHERE return_value IS NULL").fetchone()[0] == 312


def test_dirty_text_is_decoded(tmp_path):
    path = copy_fixture("pipit__saxpy-mpi-cuda_nsys_perlmutter0.sqlite", tmp_path)
    with sqlite3.connect(path) as db:  # NUL and a non-UTF-8 byte in a label and a kernel name
        db.execute(f"UPDATE {NVTX} SET text = CAST(X'736178ff00707921' AS TEXT) WHERE text = 'saxpy'")
        db.execute("UPDATE StringIds SET value = CAST(X'7361787079ff' AS TEXT) WHERE value = 'saxpy'")
    con = duckdb.connect()
    load_nsys(con, path)
    assert con.execute("SELECT DISTINCT label FROM nsys_nvtx WHERE label LIKE 'sax%'").fetchall() == \
        [("sax\ufffdpy!",)]
    assert con.execute("SELECT DISTINCT name FROM nsys_kernels").fetchall() == [("saxpy\ufffd",)]


def test_mixed_types_and_stdlib_fallback(tmp_path, monkeypatch):
    """Values of another type in a column (SQLite allows it) and the stdlib reader give the same rows."""
    path = copy_fixture("pipit__saxpy-mpi-cuda_nsys_perlmutter0.sqlite", tmp_path)
    with sqlite3.connect(path) as db:
        db.execute(f"UPDATE {KERNEL} SET gridX = 'many', blockX = 2.5 WHERE start = 924922186")
        db.execute(f"UPDATE {RUNTIME} SET name = 42")  # pipit's user-added column, now mixed
    results = []
    for adbc in (nsys_read._adbc(), None):
        monkeypatch.setattr(nsys_read, "adbc", adbc)
        con = duckdb.connect()
        stats = load_nsys(con, path)
        results.append((stats["reader"], con.execute("SELECT * FROM nsys_kernels ORDER BY start_ns").fetchall(),
                        con.execute("SELECT * FROM nsys_nvtx ORDER BY start_ns, label").fetchall()))
        # SQLite's CAST: text that is no number reads as 0, a REAL is truncated
        assert con.execute("SELECT grid_x, block_x FROM nsys_kernels WHERE start_ns = 924922186").fetchone() == (0, 2)
    assert results[0][0] == "adbc" and results[1][0] == "sqlite3"
    assert results[0][1:] == results[1][1:]


def test_align_without_exports():
    assert align_nsys(duckdb.connect(), "s0") == {}


# -- bad input -----------------------------------------------------------------------------------------


def make_bad(kind: str, tmp_path: Path) -> Path:
    path = tmp_path / f"bad-{kind}.sqlite"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random-bytes":
        path.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        data = (FIXTURES / "sc23__report3.sqlite").read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif kind == "truncated-header":
        path.write_bytes((FIXTURES / "sc23__report3.sqlite").read_bytes()[:60])
    elif kind == "other-sqlite":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE users (id INTEGER, name TEXT)")
            db.execute("INSERT INTO users VALUES (1, 'a')")
    elif kind == "nothing-usable":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
            db.execute("CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER)")
    elif kind == "core-column-missing":
        path = copy_fixture("sc23__report3.sqlite", tmp_path)
        with sqlite3.connect(path) as db:
            db.execute(f'ALTER TABLE {KERNEL} DROP COLUMN "end"')
    elif kind == "directory":
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "random-bytes", "truncated",
                                  "truncated-header", "other-sqlite", "nothing-usable", "core-column-missing"])
def test_bad_input_is_one_line_error(kind, tmp_path):
    path = make_bad(kind, tmp_path)
    con = duckdb.connect()
    with pytest.raises(KvtraceError) as err:
        load_nsys(con, path)
    message = str(err.value)
    assert path.name in message and "\n" not in message, message


def test_failed_load_leaves_no_rows(tmp_path):
    con = duckdb.connect()
    load_nsys(con, FIXTURES / "sc23__report3.sqlite")
    bad = make_bad("core-column-missing", tmp_path)
    with pytest.raises(KvtraceError):
        load_nsys(con, bad)
    assert con.execute("SELECT count(DISTINCT nsys_file) FROM nsys_kernels").fetchone()[0] == 1


# -- alignment and per-step joins ---------------------------------------------------------------------

OFFSET = 10**12  # our clock = nsys clock + OFFSET in the built export
GPID = (1 << 48) | (4242 << 24)
ENGINE_TID, WORKER_TID = GPID | 4242, GPID | 4243
STEPS = {1: (1_000_000, 2_000_000), 2: (2_000_000, 3_000_000), 3: (3_500_000, 4_500_000)}  # nsys ns


class ExportBuilder:
    """A copy of a real export with its event tables emptied, to add events at known nsys times."""

    TABLES = (KERNEL, RUNTIME, MEMCPY, MEMSET, NVTX)

    def __init__(self, path: Path, base: str = ALIGN_BASE):
        shutil.copyfile(FIXTURES / base, path)
        self.path = path
        self.db = sqlite3.connect(path)
        self.db.row_factory = sqlite3.Row
        self.templates = {t: dict(self.db.execute(f"SELECT * FROM {t} LIMIT 1").fetchone()) for t in self.TABLES}
        for t in self.TABLES:
            self.db.execute(f"DELETE FROM {t}")
        self.next_id = self.db.execute("SELECT max(id) + 1 FROM StringIds").fetchone()[0]

    def string(self, value: str) -> int:
        self.db.execute("INSERT INTO StringIds VALUES (?, ?)", (self.next_id, value))
        self.next_id += 1
        return self.next_id - 1

    def add(self, table: str, **fields) -> None:
        row = {**self.templates[table], **fields}
        cols = ", ".join(f'"{c}"' for c in row)
        self.db.execute(f"INSERT INTO {table} ({cols}) VALUES ({', '.join('?' * len(row))})", list(row.values()))

    def nvtx(self, start, end, text=None, event_type=59, domain=0, tid=ENGINE_TID, registered=True):
        text_id = self.string(text) if registered and text is not None else None
        self.add(NVTX, start=start, end=end, eventType=event_type, domainId=domain, globalTid=tid,
                 text=None if registered else text, textId=text_id, rangeId=None, category=None,
                 endGlobalTid=None, int64Value=None, uint64Value=None)

    def launch(self, corr: int, at: int, name: str = "cudaLaunchKernel_v7000") -> None:
        self.add(RUNTIME, start=at, end=at + 5_000, correlationId=corr, globalTid=WORKER_TID,
                 nameId=self.string(name))

    def kernel(self, corr: int, start: int, end: int, name: str) -> None:
        sid = self.string(name)
        self.add(KERNEL, start=start, end=end, correlationId=corr, globalPid=GPID, deviceId=0,
                 shortName=sid, demangledName=sid, mangledName=None)

    def close(self) -> Path:
        self.db.commit()
        self.db.close()
        return self.path


def build_run(path: Path, marks: bool = True) -> Path:
    """Three engine steps with our marks and ranges, two layer ranges, kernels and a memcpy."""
    b = ExportBuilder(path)
    b.nvtx(500_000, None, "kvtrace", event_type=75, domain=5, registered=False)
    for (step, (start, end)), jitter in zip(STEPS.items(), (0, 3, -2), strict=True):
        if marks:  # nsys stamps the mark 50 ns after our clock read (+ jitter)
            b.nvtx(start + 50, None, f"kvtrace:step={step}:mono_ns={start + 50 + OFFSET + jitter}", event_type=34,
                   domain=5, registered=step != 2)
        b.nvtx(start + 60, end - 10, f"kvtrace step {step}", domain=5)
    b.nvtx(1_100_000, 1_300_000, "kvtrace layer 0", domain=5, tid=WORKER_TID)
    b.nvtx(1_300_000, 1_500_000, "kvtrace layer 1", domain=5, tid=WORKER_TID)
    b.launch(10, 1_120_000, "cudaMemcpyAsync_v3020")
    b.add(MEMCPY, start=1_130_000, end=1_180_000, correlationId=10, globalPid=GPID, deviceId=0, bytes=4096,
          copyKind=1, srcKind=1, dstKind=2)
    b.launch(11, 1_150_000)
    b.kernel(11, 1_200_000, 1_260_000, "k_layer0")
    b.launch(12, 1_350_000)
    b.kernel(12, 1_400_000, 1_500_000, "k_layer1")
    b.launch(13, 2_100_000)
    b.kernel(13, 2_950_000, 3_100_000, "k_late")  # launched in step 2, runs past its end
    b.kernel(999, 3_600_000, 3_700_000, "k_graph")  # no runtime call: attributed by GPU start
    b.kernel(998, 5_000_000, 5_100_000, "k_after")  # after the last step
    return b.close()


def test_duplicate_correlation_ids(tmp_path):
    """Two runtime calls with one correlation id: still one row per kernel, matched to the earlier call."""
    b = ExportBuilder(tmp_path / "dup.sqlite")
    b.launch(7, 1_000, "cudaLaunchKernel_first")
    b.launch(7, 2_000, "cudaLaunchKernel_second")
    b.kernel(7, 10_000, 20_000, "k")
    con = duckdb.connect()
    stats = load_nsys(con, b.close())
    assert stats["rows"]["nsys_kernels"] == 1 and stats["rows"]["nsys_runtime"] == 2
    assert con.execute("SELECT launch_name, launch_start_ns FROM nsys_kernels").fetchall() == \
        [("cudaLaunchKernel_first", 1_000)]


def make_session_tables(con, session: str, start_utc_ns: int = 0, start_monotonic_ns: int = 0) -> None:
    con.execute("CREATE TABLE steps (session VARCHAR, rank INTEGER, pid INTEGER, step BIGINT, t_start_ns BIGINT, "
                "t_sched_end_ns BIGINT, t_end_ns BIGINT)")
    for step, (start, end) in STEPS.items():
        con.execute("INSERT INTO steps VALUES (?, 0, 4242, ?, ?, ?, ?)",
                    [session, step, start + OFFSET, start + OFFSET + 10_000, end + OFFSET])
    con.execute("CREATE TABLE sessions (session VARCHAR, start_utc_ns BIGINT, start_monotonic_ns BIGINT)")
    con.execute("INSERT INTO sessions VALUES (?, ?, ?)", [session, start_utc_ns, start_monotonic_ns])


def test_nvtx_mark_alignment_and_step_views(tmp_path):
    con = duckdb.connect()
    make_session_tables(con, "s1")
    path = build_run(tmp_path / "run.sqlite")
    stats = load_nsys(con, path, session="s1")
    assert (stats["alignment"], stats["offset_ns"]) == ("nvtx-mark", OFFSET)
    assert con.execute("SELECT align_marks, align_spread_ns FROM nsys_exports").fetchone() == (3, 5)
    assert align_nsys(con, "s1") == {"run.sqlite": {"alignment": "nvtx-mark", "offset_ns": OFFSET, "marks": 3}}
    assert con.execute("SELECT t_start_ns, t_launch_ns FROM nsys_kernels WHERE name = 'k_layer0'").fetchone() == \
        (1_200_000 + OFFSET, 1_150_000 + OFFSET)

    per_step = con.execute("SELECT step, kernels, gpu_ns, top_names FROM nsys_step_kernels ORDER BY step").fetchall()
    assert per_step == [(1, 2, 160_000, ["k_layer1", "k_layer0"]), (2, 1, 150_000, ["k_late"]),
                        (3, 1, 100_000, ["k_graph"])]
    assert con.execute("SELECT step, copy_kind, copies, bytes, gpu_ns FROM nsys_step_memcpy").fetchall() == \
        [(1, "HtoD", 1, 4096, 50_000)]
    gaps = con.execute("SELECT step, device_id, window_ns, busy_ns, idle_ns, max_gap_ns FROM nsys_step_gpu_gaps "
                       "ORDER BY step").fetchall()
    assert gaps == [(1, 0, 1_000_000, 210_000, 790_000, 500_000), (2, 0, 1_000_000, 50_000, 950_000, 950_000),
                    (3, 0, 1_000_000, 100_000, 900_000, 800_000)]
    layers = con.execute("SELECT layer, ranges, cpu_ns, kernels, gpu_ns FROM nsys_layer_gpu_time ORDER BY 1").fetchall()
    assert layers == [(0, 1, 200_000, 1, 60_000), (1, 1, 200_000, 1, 100_000)]

    steps = run_query(con, "step_kernels", {"session": "s1"})[1]
    assert [r[:3] for r in steps] == [("s1", 0, 1), ("s1", 0, 2), ("s1", 0, 3)]
    cols, rows = run_query(con, "step_gpu_time", {})
    assert len(rows) == 3 and "idle_ns" in cols


def test_utc_approx_alignment(tmp_path):
    path = build_run(tmp_path / "nomarks.sqlite", marks=False)
    utc_epoch_ns = 1_700_000_000_000_000_000
    with sqlite3.connect(path) as db:
        db.execute("UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = ?", (utc_epoch_ns,))
    con = duckdb.connect()
    stats = load_nsys(con, path, session="s2")  # session tables not loaded yet: nothing to align with
    assert stats["alignment"] == "none"
    assert con.execute("SELECT count(t_start_ns) FROM nsys_kernels").fetchone()[0] == 0
    # our clock read 5e9 at UTC utc_epoch_ns - 1 ms; nsys time 0 is utc_epoch_ns
    make_session_tables(con, "s2", start_utc_ns=utc_epoch_ns - 1_000_000, start_monotonic_ns=5_000_000_000)
    expected = 5_000_000_000 + 1_000_000
    assert align_nsys(con, "s2") == {"nomarks.sqlite": {"alignment": "utc-approx", "offset_ns": expected, "marks": 0}}
    assert con.execute("SELECT alignment, offset_ns FROM nsys_exports").fetchone() == ("utc-approx", expected)
    assert con.execute("SELECT t_start_ns - start_ns FROM nsys_kernels").fetchall() == [(expected,)] * 5
    # loaded again with the session present: aligned at load
    assert load_nsys(con, path, session="s2")["alignment"] == "utc-approx"


def test_utc_approx_uses_system_clock(tmp_path):
    con = duckdb.connect()
    con.execute("CREATE TABLE sessions (session VARCHAR, start_utc_ns BIGINT, start_monotonic_ns BIGINT)")
    con.execute("INSERT INTO sessions VALUES ('s3', 1779630014975716426, 7)")
    stats = load_nsys(con, FIXTURES / "nsys-ai__h100_2gpu_1s.sqlite", session="s3")
    # UTC(nsys t) = utcEpochNs + t - systemClockNs (2026 exports); ours(UTC u) = u - start_utc_ns + 7
    assert (stats["alignment"], stats["offset_ns"]) == ("utc-approx", 7 - 35255823190)


# -- canned queries ------------------------------------------------------------------------------------


def test_summary_queries(loaded):
    con, _stats = loaded
    cols, rows = run_query(con, "kernel_summary", {})
    assert cols[:3] == ["time_pct", "total_ns", "instances"] and cols[-1] == "name"
    total = con.execute("SELECT count(*) FROM nsys_kernels").fetchone()[0]
    assert sum(r[2] for r in rows) == total
    assert abs(sum(r[0] for r in rows) - 100) < 0.5
    cols, rows = run_query(con, "memcpy_summary", {})
    ops = {r[cols.index("operation")] for r in rows}
    assert {"[CUDA memcpy HtoD]", "[CUDA memcpy DtoH]", "[CUDA memset]"} <= ops
    cols, rows = run_query(con, "nvtx_summary", {})
    by_range = {(r[cols.index("domain")], r[cols.index("range")]): r for r in rows}
    assert by_range[("MPI", "MPI_Send")][cols.index("instances")] == 10
    assert run_query(con, "kernel_summary", {"session": "no-such-session"})[1] == []


def test_queries_run_without_nsys_data():
    con = duckdb.connect()
    make_session_tables(con, "s0")
    create_nsys_tables(con)
    for name in ("kernel_summary", "memcpy_summary", "nvtx_summary", "step_kernels", "step_gpu_time"):
        assert run_query(con, name, {})[1] == [], name
