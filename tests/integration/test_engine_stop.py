"""The engine-stop probe: an engine process that vLLM's front end stops while it is busy (SIGTERM, then
SIGKILL at once: the offline LLM's shutdown timeout is 0) still leaves every row it held on disk.

The engine here is a real recording process (a `Recorder` holding rows it has not written yet); the
stop is vLLM's own `vllm.v1.engine.utils.shutdown`, with and without the probe.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pyarrow as pa

from kvtrace.format.session import proc_dirs, read_proc

ROWS = 5


def _busy_engine(session_dir: str, ready) -> None:
    """A recording process that holds ROWS rows in memory (its writer flushes hourly) and never stops
    on its own, as an engine in the middle of a step."""
    from kvtrace.record.recorder import Recorder

    rec = Recorder(session_dir, "engine", {"flush_interval_s": 3600})
    events = rec.buffer("request_events")
    for i in range(ROWS):
        events.append((i, i, f"req-{i}", "arrival", 16, None))
    ready.set()
    while True:
        time.sleep(0.01)


class _FrontEndRecorder:
    """What a probe needs of the front end's recorder (the test process has none of its own)."""

    def __init__(self, session_dir: Path):
        self.session_dir = session_dir
        self.info: dict = {"probes": {}}

    def set_probe_status(self, name: str, status: str, reason: str = "") -> None:
        self.info["probes"][name] = {"status": status, "reason": reason}

    def warn(self, message: str) -> None:
        self.info.setdefault("warnings", []).append(message)


def _stop_busy_engine(session_dir: Path, with_probe: bool) -> tuple[str, int]:
    """Start a busy engine, stop it the way vLLM's front end does; its proc.json status and rows on disk."""
    import vllm.v1.engine.utils as engine_utils

    from kvtrace.probes.vllm.engine_stop import EngineStopProbe

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_busy_engine, args=(str(session_dir), ready), daemon=True)
    proc.start()
    assert ready.wait(60), "the engine process did not start"
    probe = EngineStopProbe(_FrontEndRecorder(session_dir), {})
    if with_probe:
        assert probe.install_now(), probe.rec.info
        assert probe.rec.info["probes"]["engine_stop"]["status"] == "attached"
    try:
        engine_utils.shutdown([proc], timeout=0)
    finally:
        probe.uninstall()
    proc.join(10)
    assert not proc.is_alive()
    [proc_dir] = proc_dirs(session_dir)
    rows = 0
    for shard in proc_dir.glob("request_events.*"):
        try:
            with pa.ipc.open_stream(shard.read_bytes()) as reader:
                rows += sum(b.num_rows for b in reader)
        except pa.ArrowInvalid:  # a shard left open by the kill holds no complete batch
            pass
    return read_proc(proc_dir).get("status"), rows


def test_engine_stopped_while_busy_flushes_first(tmp_path):
    status, rows = _stop_busy_engine(tmp_path / "with", with_probe=True)
    assert (status, rows) == ("flushed", ROWS)


def test_without_the_probe_the_same_stop_loses_the_rows(tmp_path):
    """The case the probe exists for: vLLM's stop alone kills the engine before it writes anything."""
    status, rows = _stop_busy_engine(tmp_path / "without", with_probe=False)
    assert (status, rows) == ("running", 0)
