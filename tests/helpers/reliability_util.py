"""Helpers for the reliability tests that damage real recorded vLLM runs (tests/test_reliability_*.py).

A recording is started as `kvtrace record` in its own process group (so a test can always clean up
everything it started), its output goes to files (a pipe could fill and block vLLM), and the test watches
the session's proc.json files to know when there is data to lose.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.run import JOB_PATTERN, VLLM_ENV, kvtrace_cmd, query, run_kvtrace  # noqa: F401 (query: re-exported)

STARTUP_S = 420  # a vLLM start on a busy 2-core machine has been seen to take 90 s; several at once, more


@dataclass
class Recording:
    """One `kvtrace record` run started in the background."""

    session: Path
    proc: subprocess.Popen
    out_path: Path
    err_path: Path
    child_pgid: int | None = None
    notes: dict = field(default_factory=dict)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def child(self) -> int:
        """The pid of the recorded command (= its process group id: record starts it in a new session)."""
        if self.child_pgid is None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                kids = _children(self.proc.pid)
                if kids:
                    self.child_pgid = kids[0]
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("kvtrace record started no child")
        return self.child_pgid

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"kvtrace record did not exit within {timeout} s:\n{self.stderr[-3000:]}") from None

    def kill_all(self) -> None:
        """Leave nothing behind, whatever happened (test cleanup)."""
        for pgid in {self.child_pgid, self.proc.pid}:
            if pgid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)


def _children(pid: int) -> list[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children()]
    except Exception:
        return []


def start_record(session: Path, command: list[str], record_args: list[str] | None = None,
                 env: dict | None = None, log_dir: Path | None = None,
                 sigint_ignored: bool = False) -> Recording:
    """Start `kvtrace record -o SESSION [record_args] -- command` in the background; its stdout and
    stderr go to LOG_DIR (default: next to the session) as SESSION-NAME.stdout / .stderr.
    `sigint_ignored`: start it with SIGINT ignored, as a non-interactive shell starts `cmd &`."""
    session.parent.mkdir(parents=True, exist_ok=True)
    log_dir = log_dir or session.parent
    out, err = log_dir / f"{session.name}.stdout", log_dir / f"{session.name}.stderr"
    full_env = {**os.environ, **VLLM_ENV, **(env or {})}
    proc = subprocess.Popen(kvtrace_cmd("record", "-o", str(session), *(record_args or []), "--", *command),
                            stdout=open(out, "wb"), stderr=open(err, "wb"), env=full_env,
                            start_new_session=True,
                            preexec_fn=_ignore_sigint if sigint_ignored else None)
    return Recording(session, proc, out, err)


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def workload_cmd(model: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvtrace.demo.workload", "--model", model, *args]


def serve_cmd(model: str, port: int, *args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "vllm"), "serve", model, "--port", str(port), "--host", "127.0.0.1",
            "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--block-size", "32",
            "--max-num-seqs", "8", "--served-model-name", "tiny", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def procs(session: Path) -> list[dict]:
    """Every proc.json of the session (skipping one caught mid-replace)."""
    out = []
    for p in sorted((session / "procs").glob("*/proc.json")):
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(p.read_text())
            doc["_dir"] = p.parent
            out.append(doc)
    return out


def rows(doc: dict, table: str) -> int:
    return int((doc.get("rows_written") or {}).get(table, 0))


def wait_until(predicate, timeout: float, what: str, rec: Recording | None = None, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if rec is not None and rec.proc.poll() is not None:
            raise AssertionError(f"kvtrace record exited ({rec.proc.returncode}) while waiting for {what}:\n"
                                 f"{rec.stderr[-4000:]}")
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" +
                         (f":\n{rec.stderr[-4000:]}" if rec else ""))


def engine_with_steps(rec: Recording, min_steps: int = 5) -> dict | None:
    """The engine's proc.json once it has flushed `min_steps` steps (and its worker has flushed too)."""
    docs = procs(rec.session)
    eng = [d for d in docs if d.get("role") == "engine" and rows(d, "steps") >= min_steps]
    workers = [d for d in docs if d.get("role") == "worker" and sum(
        v for k, v in (d.get("rows_written") or {}).items() if k != "clock_anchors") > 0]
    return eng[0] if eng and workers else None


def group_gone(pgid: int) -> bool:
    """No process of the group is left running. Zombies do not count: an orphan killed with its group
    waits for init to reap it, which in a container can take seconds; it runs nothing."""
    return not group_members(pgid)


def group_members(pgid: int) -> list[str]:
    """The group's processes that have not exited (zombies excluded)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        with contextlib.suppress(Exception):
            if os.getpgid(p.pid) == pgid and p.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                found.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
    return found


def http_json(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except Exception:
        return False


def ingest(session: Path, db: Path) -> subprocess.CompletedProcess:
    return run_kvtrace("ingest", str(session), "-o", str(db), "--job-pattern", JOB_PATTERN, check=False,
                       timeout=300)


def manifest(session: Path) -> dict:
    return json.loads((session / "manifest.json").read_text())


def kvtrace_warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "kvtrace: warning:" in line]


def session_line(stderr: str) -> str:
    """`kvtrace record`'s closing line ("kvtrace: session DIR (status, exit N)"): the last such line,
    followed only by the session's problems, one indented line each."""
    lines = stderr.strip().splitlines()
    at = max((i for i, line in enumerate(lines) if line.startswith("kvtrace: session ")), default=None)
    assert at is not None, lines[-5:]
    assert all(line.startswith("kvtrace:   ") for line in lines[at + 1:]), lines[at:]
    return lines[at]
