"""Signals between `kvtrace record` (or vLLM's front end) and the recording processes: "flush now"
(SIGUSR2) and waiting for a process group to end, read from /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from kvtrace.format.session import proc_dirs, read_proc


def request_flush(session_dir: Path, timeout_s: float = 2.0, pgid: int | None = None,
                  pids: set[int] | None = None) -> None:
    """Ask every recording process of this host to write what it holds (SIGUSR2), and wait a moment.

    vLLM's front end kills its engine right after asking it to stop, so the engine's last rows must be
    on disk before the stop signal goes out. With `pgid`, only processes of that process group (the
    recorded command's) are signalled: a recorded process that was killed stays `running` in its
    proc.json, and its pid may since belong to an unrelated process, which SIGUSR2 would terminate.
    With `pids`, only those (live processes the caller knows: probes/vllm/engine_stop.py)."""
    import socket

    asked: dict[Path, int] = {}
    host = socket.gethostname()
    for p in proc_dirs(session_dir):
        proc = read_proc(p)
        pid = int(proc.get("pid") or 0)
        if pid <= 0 or proc.get("host", host) != host or proc.get("status") in ("complete", "flushed"):
            continue
        if pids is not None and pid not in pids:
            continue
        if pgid is not None:
            try:
                if os.getpgid(pid) != pgid:
                    continue
            except (ProcessLookupError, PermissionError):
                continue
        try:
            os.kill(pid, signal.SIGUSR2)
            asked[p] = pid
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while asked and time.monotonic() < deadline:
        asked = {p: pid for p, pid in asked.items() if read_proc(p).get("status") not in ("flushed", "complete")}
        time.sleep(0.02)


def wait_group_exit(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _group_running(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # stragglers past the grace period


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies do not count: a process orphaned by the
    command's exit (multiprocessing's resource tracker, vLLM's engine) is reaped by init, which in a
    container can take seconds after it has finished, and the recording was closed long before."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        return any(len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X")
                   for _pid, fields in proc_stats())
    except OSError:
        return True  # no /proc: the signal test is all there is


def proc_stats() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, fields of /proc/PID/stat after "pid (comm)": state, ppid, pgrp, ...) of every process; a
    process gone while listed is skipped. OSError (on the first item) when there is no /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                yield int(entry), f.read().rsplit(b")", 1)[1].split()  # comm may hold spaces and ")"
        except (OSError, IndexError):
            continue


def descendants(pids: set[int]) -> set[int]:
    """`pids` and every process below them (workers are the engine's children), from /proc."""
    children: dict[int, list[int]] = {}
    try:
        for pid, fields in proc_stats():
            if len(fields) > 1:
                children.setdefault(int(fields[1]), []).append(pid)
    except OSError:
        return set(pids)  # no /proc: the processes vLLM named are all there is
    found, todo = set(pids), list(pids)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
