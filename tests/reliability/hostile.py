"""A generated corpus of hostile inputs, and the runner that feeds them to kvtrace's CLI.

    python -m tests.reliability.hostile ROOT      # writes ROOT/cases.json and the inputs under ROOT
    python -m tests.reliability.hostile --run ROOT RESULTS.json   # runs them (tests/reliability/test_hostile_corpus.py)

Every case is one kvtrace command line over one input made here, from a small valid synthetic session
(kvtrace.testing.synth), a real cut-down Nsight export (tests/data/bad/nsys_small.sqlite), a real
database and a real Parquet dataset, each damaged in one way: a manifest or proc.json field of every
name given values of the wrong kind, nested fields too; JSON that is deep, huge, not JSON or not UTF-8;
special files (FIFOs, /dev/zero, link loops) where files and folders go; shard bytes cut or flipped;
job patterns; databases and dataset descriptions that are damaged or crafted; Nsight exports missing
tables or holding wrong values. What every case must end in (test_hostile_corpus.py): a one-line
`kvtrace: error:` and exit 1, or exit 0 with the data the undamaged parts hold; no file outside the
command's `-o` changed; no network; memory under the runner's limit.

The runner runs every case in one process, through `kvtrace.cli.main` (what `kvtrace` runs), with
RLIMIT_AS set (the memory bound, MEMORY_LIMIT_BYTES) and every socket call refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NSYS = REPO / "tests" / "data" / "bad" / "nsys_small.sqlite"
MEMORY_LIMIT_BYTES = 4 << 30  # address space of the runner process (Python + DuckDB + pyarrow mapped)
CASE_TIMEOUT_S = 60
BASE_EVENTS = 2000

# Values of the wrong kind for a field, by what they are.
WRONG = {"null": None, "bool": True, "huge": 2**70, "text": "x", "list": [1], "dict": {"a": {"b": 1}}}
MANIFEST_FIELDS = ("schema_version", "session_id", "status", "command", "options", "engine_config", "env",
                   "host", "probes", "procs", "problems", "dropped", "clock", "exit_code", "kvtrace_version",
                   "vllm_version", "synthesized")
MANIFEST_NESTED = {
    "clock": ("start_monotonic_ns", "start_utc_ns", "end_monotonic_ns", "end_utc_ns"),
    "engine_config": ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"),
    "options": ("job_pattern", "kv_granularity", "kv_layers", "record_tokens"),
    "probes": ("scheduler",), "dropped": ("steps",), "host": ("hostname",),
}
NESTED_WRONG = {"text": "x", "huge": 2**70, "negative_huge": -2**70, "float": 1.5, "list": [], "null": None}
PROC_FIELDS = ("pid", "rank", "role", "host", "status", "probes", "rows_written", "dropped", "engine_config",
               "started_ns", "last_flush_ns", "stopped_reason", "hot_path", "probes_installed", "schema_version")
PROC_NESTED = {"rows_written": ("steps",), "dropped": ("steps", "block_events"), "probes": ("scheduler",),
               "engine_config": ("block_size",)}
# JSON documents that are not what a manifest is (written as text).
JSON_TEXTS = {
    "deep_list": "[" * 100_000 + "]" * 100_000,
    "deep_dict": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "nan": '{"schema_version": NaN}',
    "infinity": '{"schema_version": Infinity}',
    "long_int": '{"schema_version": ' + "9" * 10_000 + "}",
    "duplicate_keys": '{"schema_version": 1, "schema_version": "x"}',
    "bom": "\ufeff{}",
    "trailing": '{"schema_version": 1} x',
    "empty": "",
    "null": "null",
    "list": "[]",
    "number": "1",
    "huge_string": '{"session_id": "' + "a" * (3 << 20) + '"}',
}
JOB_PATTERNS = {
    "unbalanced": "(", "lookahead": r"(?P<job>\w+)(?=-)", "lookbehind": r"(?<=j)(?P<job>\d+)",
    "backreference": r"(?P<job>\w)(?P=job)", "no_groups": r"job\d+", "empty": "",
    "only_turn": r"turn(?P<turn>\d+)", "long": "(?P<job>" + "a?" * 2000 + ")", "nested_quantifiers": r"(?P<job>(a+)+)b",
    "conditional": r"(?P<job>a)(?(job)b|c)", "possessive": r"(?P<job>a++)", "atomic": r"(?P<job>(?>a+))",
    "unicode_class": r"(?P<job>\p{Greek}+)", "nul": "(?P<job>\x00)", "quote": "(?P<job>')",
    "huge_repeat": r"(?P<job>a{1000}){1000}",
}


def _write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))


def _set(doc: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        if not isinstance(doc.get(p), dict):
            doc[p] = {}
        doc = doc[p]
    doc[last] = value


class Corpus:
    """Builds the inputs under `root` and the list of cases (`cases`)."""

    def __init__(self, root: Path):
        self.root = root
        self.cases: list[dict] = []
        self.base = root / "base"
        self.rng = random.Random(35)

    # ---- the undamaged inputs ---------------------------------------------------------------------
    def make_base(self) -> None:
        from kvtrace.testing import synth

        synth.generate(self.base, BASE_EVENTS, seed=35)
        self.base_proc = sorted((self.base / "procs").iterdir())[0]
        self.base_db = self.root / "base.duckdb"
        from kvtrace.ingest import ingest

        ingest([str(self.base)], str(self.base_db))
        self.base_held = holdings(str(self.base_db))

    def session_copy(self, name: str) -> Path:
        dst = self.root / "cases" / name
        shutil.copytree(self.base, dst)
        return dst

    def add(self, name: str, argv: list[str], outputs: list[Path], kind: str = "ingest",
            whole: bool | str = False) -> None:
        """A case: `argv` for kvtrace; `outputs` may be created or changed; `whole`: the damage leaves the
        shards as they were, so a successful ingest must hold exactly what the undamaged session does
        (True: the same rows and values; "rows": the same number of rows per table)."""
        self.cases.append({"name": name, "family": name.split("_")[0], "argv": [str(a) for a in argv],
                           "outputs": [str(o) for o in outputs], "kind": kind, "whole": whole})

    def ingest_case(self, name: str, session: Path, *extra: str, whole: bool | str = False) -> None:
        out = self.root / "out" / f"{name}.duckdb"
        self.add(name, ["ingest", session, "-o", out, *extra], [out, Path(f"{out}.wal"), Path(f"{out}.tmp")],
                 whole=whole)

    # ---- families ---------------------------------------------------------------------------------
    def field_cases(self, family: str, rel: Path, fields: tuple[str, ...], nested: dict[str, tuple[str, ...]]) -> None:
        """One case per field (and nested field) and wrong value of the JSON file at `rel`."""
        doc0 = json.loads((self.base / rel).read_text())
        edits = [(field, label, value) for field in fields for label, value in WRONG.items()]
        edits += [(f"{parent}.{field}", label, value) for parent, names in nested.items() for field in names
                  for label, value in NESTED_WRONG.items()]
        for dotted, label, value in edits:
            name = f"{family}_{dotted}_{label}"
            s = self.session_copy(name)
            doc = json.loads(json.dumps(doc0))
            _set(doc, dotted, value)
            _write_json(s / rel, doc)
            self.ingest_case(name, s, whole=True)

    def manifest_fields(self) -> None:
        self.field_cases("manifest", Path("manifest.json"), MANIFEST_FIELDS, MANIFEST_NESTED)

    def proc_fields(self) -> None:
        self.field_cases("proc", self.base_proc.relative_to(self.base) / "proc.json", PROC_FIELDS, PROC_NESTED)

    def json_texts(self) -> None:
        proc_rel = self.base_proc.relative_to(self.base) / "proc.json"
        for where, rel in (("manifest", Path("manifest.json")), ("proc", proc_rel)):
            for label, text in JSON_TEXTS.items():
                name = f"json_{where}_{label}"
                s = self.session_copy(name)
                (s / rel).write_text(text, encoding="utf-8")
                self.ingest_case(name, s)
            for label, data in (("utf16", json.dumps({"schema_version": 1}).encode("utf-16")),
                                ("latin1", b'{"session_id": "caf\xe9"}'), ("nul_bytes", b"\x00" * 64),
                                ("over_16_mib", b'{"a": "' + b"b" * (17 << 20) + b'"}')):
                name = f"json_{where}_{label}"
                s = self.session_copy(name)
                (s / rel).write_bytes(data)
                self.ingest_case(name, s)

    def special_files(self) -> None:
        proc_rel = self.base_proc.relative_to(self.base)
        shard = sorted(self.base_proc.glob("steps.*.arrows"))[0].relative_to(self.base)
        targets = {"manifest": Path("manifest.json"), "proc": proc_rel / "proc.json", "shard": shard}
        for where, rel in targets.items():
            for label in ("fifo", "dev_zero", "link_loop", "directory", "dangling_link", "dev_null"):
                name = f"special_{where}_{label}"
                s = self.session_copy(name)
                p = s / rel
                p.unlink()
                if label == "fifo":
                    os.mkfifo(p)
                elif label == "dev_zero":
                    p.symlink_to("/dev/zero")
                elif label == "dev_null":
                    p.symlink_to("/dev/null")
                elif label == "link_loop":
                    p.symlink_to(p.name)
                elif label == "directory":
                    p.mkdir()
                else:
                    p.symlink_to(s / "nowhere")
                self.ingest_case(name, s)
        for label in ("procs_fifo", "procs_file", "procs_link_loop", "proc_dir_fifo", "session_link_loop"):
            name = f"special_{label}"
            s = self.session_copy(name)
            if label.startswith("procs_"):
                shutil.rmtree(s / "procs")
                if label == "procs_fifo":
                    os.mkfifo(s / "procs")
                elif label == "procs_file":
                    (s / "procs").write_text("x")
                else:
                    (s / "procs").symlink_to("procs")
            elif label == "proc_dir_fifo":
                os.mkfifo(s / "procs" / "engine-1")
            else:
                shutil.rmtree(s)
                s.symlink_to(s.name)
            self.ingest_case(name, s)

    def doubles(self) -> None:
        """The same rows reachable twice: a shard beside a .partial copy of itself, a process folder
        linked or copied under another name, a session given twice."""
        proc_rel = self.base_proc.relative_to(self.base)
        shard = sorted(self.base_proc.glob("steps.*.arrows"))[0].relative_to(self.base)
        for label in ("shard_partial_copy", "shard_copy_next_number", "proc_dir_link", "proc_dir_copy",
                      "proc_dir_copy_other_pid", "session_twice", "session_link_twice"):
            name = f"double_{label}"
            s = self.session_copy(name)
            extra: list[Path] = []
            if label == "shard_partial_copy":
                shutil.copy(s / shard, s / f"{shard}.partial")
            elif label == "shard_copy_next_number":
                shutil.copy(s / shard, (s / shard).with_name(shard.name.replace(".00000.", ".00099.")))
            elif label == "proc_dir_link":
                (s / "procs" / "engine-99999").symlink_to(s / proc_rel)
            elif label.startswith("proc_dir_copy"):
                dst = s / "procs" / "engine-99999"
                shutil.copytree(s / proc_rel, dst)
                if label.endswith("other_pid"):
                    doc = json.loads((dst / "proc.json").read_text())
                    doc["pid"] = 99999
                    _write_json(dst / "proc.json", doc)
            elif label == "session_twice":
                extra = [s]
            else:
                link = self.root / "cases" / f"{name}_link"
                link.symlink_to(s)
                extra = [link]
            out = self.root / "out" / f"{name}.duckdb"
            # A copy under another pid: the rows are read once, under whichever folder sorts first.
            self.add(name, ["ingest", s, *extra, "-o", out], [out, Path(f"{out}.wal"), Path(f"{out}.tmp")],
                     whole="rows" if label.endswith("other_pid") else True)

    def foreign_outputs(self) -> None:
        """`-o` naming a file kvtrace did not write: refused, and left as it was (not among the outputs)."""
        import duckdb

        d = self.root / "foreign"
        d.mkdir()
        made = {}
        con = duckdb.connect(str(d / "other_tool.duckdb"))
        con.execute("CREATE TABLE sessions (id INTEGER, who VARCHAR); INSERT INTO sessions VALUES (1, 'x')")
        con.close()
        made["other_tool_duckdb"] = d / "other_tool.duckdb"
        with sqlite3.connect(d / "notes.sqlite") as lite:
            lite.execute("CREATE TABLE t (a)")
        made["sqlite"] = d / "notes.sqlite"
        made["text"] = d / "readme.txt"
        made["text"].write_text("not a database\n")
        made["png"] = d / "figure.png"
        made["png"].write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
        made["empty_dir"] = d / "folder"
        made["empty_dir"].mkdir()
        for label, target in made.items():
            self.add(f"foreign_{label}", ["ingest", self.base, "-o", target], [], kind="foreign")

    def shard_bytes(self) -> None:
        for table in ("steps", "block_events", "request_events"):
            src = sorted(self.base_proc.parent.glob(f"*/{table}.*.arrows"))
            if not src:
                continue
            rel = src[0].relative_to(self.base)
            data = src[0].read_bytes()
            for k in range(8):
                cut = self.rng.randrange(1, len(data))
                name = f"shard_{table}_cut_{k}"
                s = self.session_copy(name)
                (s / rel).write_bytes(data[:cut])
                self.ingest_case(name, s)
            for k in range(8):
                b = bytearray(data)
                for _ in range(1 + k % 3):
                    pos = self.rng.randrange(len(b))
                    b[pos] ^= 1 << self.rng.randrange(8)
                name = f"shard_{table}_flip_{k}"
                s = self.session_copy(name)
                (s / rel).write_bytes(bytes(b))
                self.ingest_case(name, s)

    def job_patterns(self) -> None:
        for label, pattern in JOB_PATTERNS.items():
            name = f"job_pattern_{label}"
            self.ingest_case(name, self.base, "--job-pattern", pattern, whole=True)

    def databases(self) -> None:
        import duckdb

        data = self.base_db.read_bytes()
        made: dict[str, Path] = {}
        d = self.root / "dbs"
        d.mkdir()
        for label, content in (("empty", b""), ("random", bytes(self.rng.randrange(256) for _ in range(4096))),
                               ("text", b"hello\n"), ("half", data[:len(data) // 2]), ("header_only", data[:4096]),
                               ("zeroed_middle", data[:8192] + b"\x00" * (len(data) - 8192))):
            made[label] = d / f"{label}.duckdb"
            made[label].write_bytes(content)
        for label, sql in (("no_sessions", "DROP TABLE sessions"), ("no_steps", "DROP VIEW IF EXISTS steps; DROP TABLE IF EXISTS steps"),
                           ("sessions_status_int", "ALTER TABLE sessions ALTER status TYPE INTEGER USING 7"),
                           ("extra_session_null", "INSERT INTO sessions (session) VALUES (NULL)")):
            made[label] = d / f"{label}.duckdb"
            shutil.copy(self.base_db, made[label])
            con = duckdb.connect(str(made[label]))
            try:
                con.execute(sql)
            except duckdb.Error:
                pass
            con.close()
        sq = d / "sqlite.duckdb"
        with sqlite3.connect(sq) as lite:
            lite.execute("CREATE TABLE sessions (session TEXT)")
        made["sqlite"] = sq
        made["directory"] = d / "dir.duckdb"
        made["directory"].mkdir()
        for label, path in made.items():
            for cmd in (["query", path, "summary"], ["query", path, "--sql", "select 1"],
                        ["export", path, "--format", "perfetto", "-o", self.root / "out" / f"db_{label}.json"]):
                outs = [Path(cmd[-1])] if cmd[0] == "export" else []
                self.add(f"db_{label}_{cmd[0]}_{cmd[2] if cmd[0] == 'query' else 'perfetto'}".replace("--", ""), cmd,
                         outs, kind="db")

    def datasets(self) -> None:
        base_ds = self.root / "base_ds"
        from kvtrace.cli import main

        try:
            main(["export", str(self.base_db), "--format", "parquet", "-o", str(base_ds)])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        meta0 = json.loads((base_ds / "_kvtrace_dataset.json").read_text())
        table = next(iter(meta0["tables"]))
        edits = {
            "format_wrong": lambda m: m.update(format="x"),
            "version_text": lambda m: m.update(schema_version="3"),
            "version_future": lambda m: m.update(schema_version=99),
            "tables_list": lambda m: m.update(tables=[1]),
            "tables_text": lambda m: m.update(tables="x"),
            "table_name_quote": lambda m: m["tables"].update({'x"; COPY (SELECT 1) TO \'/tmp/kvtrace-pwned\'; --': m["tables"][table]}),
            "table_name_path": lambda m: m["tables"].update({"../../x": m["tables"][table]}),
            "column_type_sql": lambda m: m["tables"][table]["columns"].append(["z", "INTEGER); COPY (SELECT 1) TO '/tmp/kvtrace-pwned'; --"]),
            "column_name_quote": lambda m: m["tables"][table]["columns"].append(['a"b', "INTEGER"]),
            "columns_not_list": lambda m: m["tables"][table].update(columns="x"),
            "column_pair_short": lambda m: m["tables"][table]["columns"].append(["only"]),
            "column_pair_numbers": lambda m: m["tables"][table]["columns"].append([1, 2]),
            "sessions_list": lambda m: m.update(sessions=[1]),
            "huge_columns": lambda m: m["tables"][table]["columns"].extend([f"c{i}", "INTEGER"] for i in range(20_000)),
        }
        for label, edit in edits.items():
            ds = self.root / "cases" / f"ds_{label}"
            shutil.copytree(base_ds, ds)
            meta = json.loads(json.dumps(meta0))
            edit(meta)
            _write_json(ds / "_kvtrace_dataset.json", meta)
            self.add(f"ds_{label}", ["query", "--dataset", ds, "summary"], [], kind="dataset")
        for label in ("meta_missing", "meta_garbage", "parquet_garbage", "parquet_empty", "meta_fifo"):
            ds = self.root / "cases" / f"ds_{label}"
            shutil.copytree(base_ds, ds)
            meta = ds / "_kvtrace_dataset.json"
            if label == "meta_missing":
                meta.unlink()
            elif label == "meta_garbage":
                meta.write_bytes(b"\xff\xfe{")
            elif label == "meta_fifo":
                meta.unlink()
                os.mkfifo(meta)
            else:
                part = sorted(ds.rglob("*.parquet"))[0]
                part.write_bytes(b"" if label == "parquet_empty" else b"PAR1" + b"\x01" * 100)
            self.add(f"ds_{label}", ["query", "--dataset", ds, "summary"], [], kind="dataset")

    def nsys(self) -> None:
        tables = [r[0] for r in sqlite3.connect(NSYS).execute("select name from sqlite_master where type='table'")]
        d = self.root / "nsys"
        d.mkdir()
        edits: dict[str, str] = {f"drop_{t}": f"DROP TABLE {t}" for t in tables}
        edits.update({
            "kernel_start_text": "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'x'",
            "kernel_end_before_start": "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 1000",
            "kernel_start_null": "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL",
            "kernel_name_dangling": "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET shortName = 999999999",
            "nvtx_text_blob": "UPDATE NVTX_EVENTS SET text = x'fffe00'",
            "nvtx_start_real": "UPDATE NVTX_EVENTS SET start = 1.5",
            "session_start_text": "UPDATE TARGET_INFO_SESSION_START_TIME SET utcEpochNs = 'x'",
            "session_start_two_rows": "INSERT INTO TARGET_INFO_SESSION_START_TIME SELECT * FROM TARGET_INFO_SESSION_START_TIME",
            "stringids_dup": "INSERT INTO StringIds SELECT * FROM StringIds",
            "memcpy_bytes_negative": "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET bytes = -5",
            "runtime_huge_tid": "UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET globalTid = 9223372036854775807",
        })
        for label, sql in edits.items():
            path = d / f"{label}.sqlite"
            shutil.copy(NSYS, path)
            with sqlite3.connect(path) as lite:
                try:
                    lite.executescript(sql)
                except sqlite3.Error:
                    pass
            out = self.root / "out" / f"nsys_{label}.duckdb"
            self.add(f"nsys_{label}", ["ingest", "--nsys", path, "-o", out], [out, Path(f"{out}.wal"), Path(f"{out}.tmp")],
                     kind="nsys")

    def build(self) -> list[dict]:
        (self.root / "cases").mkdir(parents=True)
        (self.root / "out").mkdir()
        self.make_base()
        for family in (self.manifest_fields, self.proc_fields, self.json_texts, self.special_files,
                       self.doubles, self.foreign_outputs, self.shard_bytes, self.job_patterns, self.databases, self.datasets, self.nsys):
            family()
        (self.root / "cases.json").write_text(json.dumps({"base_held": self.base_held, "cases": self.cases}))
        return self.cases


# ---- the runner ---------------------------------------------------------------------------------------
def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (not following links): path -> (kind, size, mtime_ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            # A folder's own size and time change when an allowed output appears in it: its entries say
            # what changed, so only that it is a folder counts.
            is_dir = st.st_mode >> 12 == 0o04
            out[p] = (st.st_mode >> 12, 0 if is_dir else st.st_size, 0 if is_dir else st.st_mtime_ns)
    return out


HELD = ("steps", "request_events", "block_events", "prefix_lookups", "kv_access", "step_requests")


def holdings(db: str) -> Any:
    """What a database holds, to compare with the undamaged session's: per table its rows and a hash
    of their values (the session id left out)."""
    import duckdb

    try:
        con = duckdb.connect(db, read_only=True)
        try:
            return {t: list(con.execute(f"select count(*), coalesce(sum(hash(x)), 0)::VARCHAR "
                                        f"from (select * exclude (session) from {t}) x").fetchone()) for t in HELD}
        finally:
            con.close()
    except Exception as exc:  # noqa: BLE001
        return f"unreadable: {exc}"


def _no_network() -> list[str]:
    """Refuse every socket connection and name lookup from Python; returns the list attempts go to."""
    import socket

    attempts: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(repr(args[:2]))
        raise OSError("network refused by the hostile-input runner")

    socket.socket.connect = refuse  # type: ignore[method-assign]
    socket.socket.connect_ex = refuse  # type: ignore[method-assign]
    socket.getaddrinfo = refuse  # type: ignore[assignment]
    socket.create_connection = refuse  # type: ignore[assignment]
    return attempts


def run(root: Path, results_path: Path) -> None:
    import contextlib
    import io
    import resource
    import signal
    import time

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    attempts = _no_network()
    from kvtrace.cli import main

    spec = json.loads((root / "cases.json").read_text())

    def timeout(signum: int, frame: Any) -> None:
        raise TimeoutError(f"case ran over {CASE_TIMEOUT_S} s")

    signal.signal(signal.SIGALRM, timeout)
    results = []
    before = _tree(root)
    for case in spec["cases"]:
        out, err = io.StringIO(), io.StringIO()
        t0 = time.monotonic()
        code: Any = None
        escaped = None
        n_attempts = len(attempts)
        signal.alarm(CASE_TIMEOUT_S)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                main(case["argv"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:  # noqa: BLE001 - what escaped kvtrace's own handling
            escaped = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            signal.alarm(0)
        held = None
        if code == 0 and case["kind"] == "ingest":
            held = holdings(case["argv"][case["argv"].index("-o") + 1])
        after = _tree(root)
        allowed = set(case["outputs"])
        changed = sorted(p for p in set(before) | set(after)
                         if before.get(p) != after.get(p) and p not in allowed
                         and not any(p.startswith(o + os.sep) for o in allowed))
        before = after
        results.append({"name": case["name"], "code": code, "escaped": escaped, "stderr": err.getvalue()[-2000:],
                        "stdout_bytes": len(out.getvalue()), "seconds": round(time.monotonic() - t0, 3),
                        "held": held, "changed": changed[:10], "network": attempts[n_attempts:]})
    usage = resource.getrusage(resource.RUSAGE_SELF)
    results_path.write_text(json.dumps({"results": results, "max_rss_bytes": usage.ru_maxrss * 1024,
                                        "memory_limit_bytes": MEMORY_LIMIT_BYTES}))


if __name__ == "__main__":
    if sys.argv[1] == "--run":
        run(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        Corpus(Path(sys.argv[1])).build()
