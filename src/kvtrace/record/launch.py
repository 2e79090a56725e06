"""`kvtrace record -- CMD`: run a command unchanged with kvtrace's probes in every vLLM process.

The command runs as a child in its own process group with `KVTRACE_SESSION` and `KVTRACE_OPTIONS` in
its environment; vLLM loads kvtrace's general plugin in each of its processes, and the plugin records
only when those variables are set. SIGINT and SIGTERM are forwarded to the child's process group so vLLM
shuts down its own way; a second SIGINT kills the group so nothing is left behind. When the child ends,
the session's manifest is finalised (exit code, per-process status, probes, losses) and kvtrace exits
with the child's status.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.format.schema import PROBE_FINE_STATUSES
from kvtrace.format.session import (
    MANIFEST,
    engine_config,
    new_manifest,
    proc_dirs,
    read_proc,
    verdict,
    write_json_atomic,
)
from kvtrace.record.signals import descendants, request_flush, wait_group_exit

PLUGIN_NAME = "kvtrace"
# How often `kvtrace record` looks for the recording processes' probe verdicts, and how many it prints.
VERDICT_POLL_S = 0.3
MAX_VERDICT_LINES = 4


def probe_verdict(doc: dict[str, Any]) -> str | None:
    """One process's probes as one line ("scheduler attached, kv_blocks disabled: ..."), from its
    proc.json; None until its plugin has installed them all."""
    probes = doc.get("probes")
    if not doc.get("probes_installed") or not isinstance(probes, dict):
        return None
    parts = []
    for name, st in sorted(probes.items()):
        st = st if isinstance(st, dict) else {}
        part = f"{name} {st.get('status')}"
        if st.get("status") not in PROBE_FINE_STATUSES and st.get("reason"):
            part += f" ({str(st['reason'])[:160]})"
        parts.append(part)
    return ", ".join(parts)


class VerdictWatcher(threading.Thread):
    """Prints, while the command runs, what each vLLM process's probes attached to: the verdict that
    `kvtrace doctor` predicts, as it really came out. One line per distinct verdict (a front end and an
    engine differ), at most MAX_VERDICT_LINES."""

    def __init__(self, session_dir: Path, vllm_version: str | None):
        super().__init__(name="kvtrace-verdicts", daemon=True)
        self.session_dir, self.vllm_version = session_dir, vllm_version
        self.done = threading.Event()
        self.printed: set[str] = set()

    def run(self) -> None:
        seen: set[Path] = set()
        while not self.done.wait(VERDICT_POLL_S) and len(self.printed) < MAX_VERDICT_LINES:
            self.poll(seen)

    def poll(self, seen: set[Path]) -> None:
        for proc_dir in proc_dirs(self.session_dir):
            if proc_dir in seen:
                continue
            doc = read_proc(proc_dir)
            line = probe_verdict(doc)
            if line is None:
                continue
            seen.add(proc_dir)
            if line not in self.printed and len(self.printed) < MAX_VERDICT_LINES:
                self.printed.add(line)
                print(f"kvtrace: probes in pid {doc.get('pid', '?')} (vLLM {self.vllm_version or '?'}): {line}",
                      file=sys.stderr, flush=True)


def prepare_session(out_dir: str | os.PathLike, command: list[str], options: dict[str, Any],
                    overwrite: bool = True) -> tuple[Path, dict[str, Any]]:
    """Create the session directory and its manifest; returns (path, manifest)."""
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise KvtraceError(f"{out}: exists and is not a directory")
    if out.exists() and (out / "procs").exists():
        if not overwrite:
            raise KvtraceError(f"{out}: already holds a session (use another -o or --force)")
        import shutil

        shutil.rmtree(out / "procs")
    try:
        out.mkdir(parents=True, exist_ok=True)
        manifest = new_manifest(command, options)
        write_json_atomic(out / MANIFEST, manifest)
    except OSError as exc:
        raise KvtraceError(f"{out}: cannot create the session directory ({exc.strerror})") from None
    return out, manifest


def session_env(session_dir: Path, options: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that switches the probes on in every process started with it."""
    env = dict(os.environ if base is None else base)
    env["KVTRACE_SESSION"] = str(session_dir)
    env["KVTRACE_OPTIONS"] = json.dumps(options)
    allow = env.get("VLLM_PLUGINS")
    if allow is not None and PLUGIN_NAME not in allow.split(","):  # an allow-list must include us
        env["VLLM_PLUGINS"] = ",".join([p for p in allow.split(",") if p] + [PLUGIN_NAME])
    return env


def finalize_session(session_dir: Path, exit_code: int | None, note: str | None = None) -> dict[str, Any]:
    """Merge what every process reported into the manifest; returns the manifest."""
    path = session_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        manifest = new_manifest([], {})
    procs, probes, dropped, docs = [], {}, {}, []
    for p in proc_dirs(session_dir):
        proc = read_proc(p)
        docs.append(proc)
        procs.append({k: proc.get(k) for k in ("pid", "role", "rank", "host", "status", "stopped_reason")})
        for name, st in (proc.get("probes") or {}).items():
            probes.setdefault(name, {})[f"{proc.get('role')}:{proc.get('pid')}"] = st
        for table, causes in (proc.get("dropped") or {}).items():
            for cause, n in causes.items():
                key = f"{table}:{cause}"
                dropped[key] = dropped.get(key, 0) + n
    engine = engine_config({}, docs)
    clean = exit_code == 0 or exit_code in (-signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGINT,
                                             128 + signal.SIGTERM)
    # "flushed": the process wrote everything it held when asked, just before it was stopped.
    all_closed = all(p["status"] in ("complete", "flushed") for p in procs)
    status, problems = verdict(clean and all_closed, docs, engine)
    manifest.update({
        "status": status,
        "problems": problems,
        "exit_code": exit_code,
        "procs": procs,
        "probes": probes,
        "dropped": dropped,
        "engine_config": engine,
    })
    manifest.setdefault("clock", {})["end_monotonic_ns"] = time.monotonic_ns()
    manifest["clock"]["end_utc_ns"] = time.time_ns()
    if note:
        manifest["note"] = note
    try:
        write_json_atomic(path, manifest)
    except OSError as exc:
        print(f"kvtrace: warning: cannot finalise {path}: {exc}", file=sys.stderr)
    return manifest


def run_recorded(command: list[str], out_dir: str | os.PathLike, options: dict[str, Any],
                 quiet: bool = False) -> int:
    """Run `command` with recording on; returns the exit status to leave with (the child's)."""
    if not command:
        raise KvtraceError("nothing to record: give a command after --, e.g. kvtrace record -- vllm serve MODEL")
    session_dir, manifest = prepare_session(out_dir, command, options)
    env = session_env(session_dir, options)
    child: subprocess.Popen | None = None
    interrupts = 0
    early: list[int] = []  # signals that came before the command started
    watcher: VerdictWatcher | None = None

    def forward(signum, _frame):
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
        if child is None:  # not started yet: it is told once it runs (below)
            early.append(signum)
            return
        try:
            if interrupts >= 2:  # the user insists: leave nothing behind
                os.killpg(child.pid, signal.SIGKILL)
            else:
                request_flush(session_dir, pgid=child.pid)
                os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    # Handlers first, then the command: a handler is reset to the default action in the new program,
    # while "ignore" is inherited. Started as `kvtrace record ... &` by a non-interactive shell (SIGINT
    # ignored), the command would otherwise ignore the SIGINT forwarded to it, and never stop.
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            child = subprocess.Popen(command, env=env, start_new_session=True)
        except FileNotFoundError:
            raise KvtraceError(f"{command[0]}: command not found") from None
        except PermissionError:
            raise KvtraceError(f"{command[0]}: permission denied") from None
        if not quiet:  # once it runs: a command that cannot start gets its one-line error alone
            version = manifest.get("vllm_version")
            print(f"kvtrace: recording into {session_dir} (vLLM {version or 'not found in this environment'}; "
                  f"`kvtrace doctor` says what it will record)", file=sys.stderr, flush=True)
            watcher = VerdictWatcher(session_dir, version)
            watcher.start()
        if early:  # a signal came while it was starting
            os.killpg(child.pid, early[-1])
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if watcher is not None:
            watcher.done.set()
    # vLLM's engine processes may outlive the front end by a moment while they flush: give them time.
    wait_group_exit(child.pid, timeout_s=15.0)
    manifest = finalize_session(session_dir, code)
    if not quiet:
        print(f"kvtrace: session {session_dir} ({manifest['status']}, exit {code})", file=sys.stderr)
        for problem in manifest.get("problems") or []:
            print(f"kvtrace:   {problem}", file=sys.stderr)
    return 128 - code if code < 0 else code  # killed by signal N: exit 128 + N, as a shell does










@contextlib.contextmanager
def session(out_dir: str | os.PathLike, **options: Any) -> Iterator[Path]:
    """Record the vLLM engines started inside the `with` block (for notebooks and scripts).

        with kvtrace.session("run1"):
            llm = LLM(model=...)   # engine processes started here are recorded
            llm.generate(...)

    At the end of the block the session is made whole, though the engines live on (the script keeps its
    LLM): every recording process started from this one writes what it holds (as on Ctrl-C under
    `kvtrace record`), this process's own recording is closed, and the manifest is finalised. What the
    engines do after the block is not part of the session.
    """
    session_dir, _ = prepare_session(out_dir, [sys.argv[0] if sys.argv else "python", "(in-process)"],
                                     options)
    saved = {k: os.environ.get(k) for k in ("KVTRACE_SESSION", "KVTRACE_OPTIONS", "VLLM_PLUGINS")}
    os.environ.update({k: v for k, v in session_env(session_dir, options).items()
                       if k in saved})
    code = 0
    try:
        yield session_dir
    except BaseException:
        code = 1
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _close_in_process(session_dir)
        finalize_session(session_dir, code)


def _close_in_process(session_dir: Path) -> None:
    """The engines started from this process write what they hold (SIGUSR2, waited for), and this
    process's own recorder of `session_dir`, if vLLM's plugin made one here, is closed and forgotten."""
    others = descendants({os.getpid()}) - {os.getpid()}
    if others:
        request_flush(session_dir, timeout_s=10.0, pids=others)
    from kvtrace.record import recorder  # only now: a script that records nothing never loads pyarrow

    rec = recorder._recorder
    if rec is not None and rec.session_dir == session_dir:
        recorder.run_flush_hooks()  # the probes' held rows first, as on a signalled flush
        rec.close()  # (the probes of this process stay bound to it: one session per script process)
