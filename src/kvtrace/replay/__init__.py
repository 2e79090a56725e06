"""What-if replay: the requests of one recording run again through vLLM's real scheduler and KV cache
manager (no model, CPU), with the same or another configuration, and recorded by kvtrace's own probes
into a normal session.

    kvtrace replay run1 -o run1-1024 --num-blocks 1024
    kvtrace ingest run1 run1-1024 -o both.duckdb && kvtrace compare ...

`--clock steps` (the default): each request is queued before the engine step it was queued before in
the recording, so at the recording's own configuration the scheduler sees what it saw. `--clock timed`:
the replay runs in the recording's time: each request is queued at the first step boundary after its
recorded arrival, and each step lasts what the recording's step-time model (clock.py) predicts for its
scheduled tokens, so arrivals and the new configuration's step times interact (a replay takes as long as
the run it predicts; a TTL policy waits in that time).
Requests keep their ids, prompt and output lengths and the block-hash structure of their sequences
(workload.py); the tokens are made up per distinct hash. docs/replay.md.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.replay.engine import VOCAB, ReplayEngine, SchedulerSettings
from kvtrace.replay.workload import Workload, read_workload, sequence

HOST_PROBES = ("scheduler", "kv_blocks", "prefix_cache")  # and "connector" with an offload tier


def settings_for(w: Workload, overrides: dict[str, Any]) -> SchedulerSettings:
    """The recording's scheduling settings, with `overrides` (engine-argument names) applied."""
    e = w.engine

    def whole(name: str, default: int | None = None) -> Any:
        value = e.get(name) if e.get(name) is not None else default
        return value  # check_settings refuses what is not a whole number in range

    s = SchedulerSettings(num_blocks=whole("num_kv_blocks"), block_size=whole("block_size"),
                          max_num_seqs=whole("max_num_seqs", 256),
                          max_num_batched_tokens=whole("max_num_batched_tokens", 2048),
                          max_model_len=whole("max_model_len", 4096),
                          enable_prefix_caching=e.get("enable_prefix_caching", True) is not False)
    for k, v in overrides.items():
        if v is not None:
            setattr(s, k, v)
    return s


# Beyond these a setting is not one a vLLM engine runs with here (a damaged manifest, a typo): refused
# rather than building a pool of that many Python objects.
MAX_BLOCKS = 1 << 24
MAX_MODEL_LEN = 1 << 24


def check_settings(s: SchedulerSettings, where: str) -> None:
    """One-line errors for settings vLLM would refuse, or that no engine has."""
    for name, value, lo, hi in (("num_blocks", s.num_blocks, 2, MAX_BLOCKS), ("block_size", s.block_size, 1, 1 << 16),
                                ("max_num_seqs", s.max_num_seqs, 1, 1 << 20),
                                ("max_num_batched_tokens", s.max_num_batched_tokens, 1, 1 << 26),
                                ("max_model_len", s.max_model_len, 1, MAX_MODEL_LEN)):
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise KvtraceError(f"{where}: {name} {shown} is outside {lo:,}..{hi:,}")
    need = -(-s.max_model_len // s.block_size)
    if need > s.num_blocks - 1:  # vLLM checks this when the engine starts: one longest request must fit
        raise KvtraceError(f"{where}: {s.num_blocks} blocks of {s.block_size} tokens (one is vLLM's null block) "
                           f"cannot hold one max_model_len {s.max_model_len} request, so vLLM would not start; "
                           f"give more --num-blocks or a smaller --max-model-len")


def replay(session_dir: str | Path, out_dir: str | Path, overrides: dict[str, Any] | None = None,
           progress: bool = False, workload: Workload | None = None, clock: str = "steps") -> dict[str, Any]:
    """Replay the recording at `session_dir` into a new session at `out_dir`; returns a short report.
    `workload`: the recording's, when the caller has read it already (a sweep replays it many times).
    `clock`: "steps" or "timed" (module docstring)."""
    from kvtrace.demo.model import ensure_tiny_model
    from kvtrace.probes import lifecycle
    from kvtrace.probes.vllm.connector import ConnectorProbe
    from kvtrace.probes.vllm.kv_blocks import BlockPoolProbe, PrefixCacheProbe
    from kvtrace.probes.vllm.scheduler import SchedulerProbe
    from kvtrace.record.context import ctx
    from kvtrace.record.launch import finalize_session, prepare_session
    from kvtrace.record.recorder import Recorder, as_process_recorder

    if Path(out_dir).resolve() == Path(session_dir).resolve():
        raise KvtraceError(f"{out_dir}: the recording itself; write the replay to another directory")
    w = workload if workload is not None else read_workload(session_dir)
    lookahead = w.engine.get("hash_lookahead_tokens")
    if lookahead:  # its prompts' block-hash structure is not the one the replay's hasher would make
        raise KvtraceError(f"{session_dir}: recorded with vLLM's lookahead block hashes (hash_lookahead_tokens "
                           f"{lookahead}, EAGLE-style drafting); replaying those is not supported yet")
    if clock not in ("steps", "timed"):
        raise KvtraceError(f"--clock {clock}: steps or timed")
    if clock == "timed" and w.step_time is None:
        raise KvtraceError(f"{session_dir}: fewer than three finished steps with tokens: no step times to fit "
                           "for --clock timed")
    s = settings_for(w, overrides or {})
    check_settings(s, f"{session_dir}")
    too_long = [r.request_id for r in w.requests if r.prompt_tokens + r.output_tokens > s.max_model_len]
    if too_long:
        raise KvtraceError(f"{session_dir}: {len(too_long)} request(s) longer than max_model_len {s.max_model_len} "
                           f"(e.g. {too_long[0]}); give --max-model-len")
    if s.scheduler_cls:
        from kvtrace.replay.engine import load_scheduler_cls

        load_scheduler_cls(s.scheduler_cls)  # refused before anything is written
    options = {"replay_of": w.session_id, "replay_settings": vars(s), "replay_clock": clock}
    if clock == "timed":
        options["replay_step_time"] = vars(w.step_time)
    out, _ = prepare_session(out_dir, ["kvtrace", "replay", str(session_dir)], options)
    rec = Recorder(out, "engine", options)
    probes = []
    ctx.step, ctx.request_id, ctx.connector = 0, None, None
    try:
        try:
            probes = lifecycle.install_classes(rec, [SchedulerProbe, BlockPoolProbe, PrefixCacheProbe]
                                               + ([ConnectorProbe] if s.cpu_offload_bytes else []))
        except RuntimeError as exc:  # this vLLM lacks what a replay records with
            raise KvtraceError(f"replay: {exc}") from None
        engine = ReplayEngine(str(ensure_tiny_model()), s)
        with as_process_recorder(rec):  # a --scheduler-cls policy's kvtrace.probes.pins calls land here
            (_run_timed if clock == "timed" else _run)(engine, w, s, session_dir, progress)
    finally:
        lifecycle.uninstall(probes)
        rec.close()
    finalize_session(out, 0)
    return {"session_dir": str(out), "requests": len(w.requests), "steps": engine.steps, "skipped": w.skipped,
            "settings": vars(s), "pid": os.getpid(), "clock": clock}


# An empty step is not a stall for a policy that waits on time (a TTL pin keeps blocks a while): the
# replay stops when its scheduler has scheduled nothing for this long.
STALL_S = 10.0


def _check_stall(engine: ReplayEngine, scheduled: Any, progressed: float, session_dir: str | Path) -> float:
    """When the replay last made progress (time.monotonic()), given the step just run; a one-line error
    once its scheduler has scheduled nothing for STALL_S."""
    if scheduled.num_scheduled_tokens or scheduled.finished_req_ids:
        return time.monotonic()
    if time.monotonic() - progressed > STALL_S:
        raise KvtraceError(f"{session_dir}: the scheduler scheduled nothing for {STALL_S:.0f} s (step "
                           f"{engine.steps:,}, {len(engine.sched.waiting)} request(s) waiting); stopped")
    return progressed


def _run(engine: ReplayEngine, w: Workload, s: SchedulerSettings, session_dir: str | Path, progress: bool) -> None:
    """Queue the recorded requests by their step (`--clock steps`) and step the engine until all are done."""
    pending, i, n = w.requests, 0, len(w.requests)
    progressed = time.monotonic()
    while i < n or engine.has_work():
        # Requests queued after step k (ctx.step = k then) are added before step k + 1 is scheduled.
        while i < n and (pending[i].queued_step <= engine.steps or not engine.has_work()):
            r = pending[i]
            engine.add(r.request_id, sequence(r, s.block_size, VOCAB), r.prompt_tokens, r.output_tokens)
            i += 1
        scheduled = engine.step()
        progressed = _check_stall(engine, scheduled, progressed, session_dir)
        if progress and engine.steps % 500 == 0:
            print(f"\rreplay: step {engine.steps:,}, {i:,}/{n:,} requests queued", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)


def _run_timed(engine: ReplayEngine, w: Workload, s: SchedulerSettings, session_dir: str | Path,
               progress: bool) -> None:
    """Queue the recorded requests at their recorded times (`--clock timed`) and pace each step to the
    recording's step-time model: the forward pass vLLM's scheduler would wait for (there is no model
    here) is waited out between schedule() and update_from_output(), and the gap to the next step after
    it, so everything the probes stamp is in the predicted run's time."""
    model = w.step_time
    assert model is not None
    pending = sorted(w.requests, key=lambda r: r.queued_ns)
    i, n = 0, len(pending)
    start = time.monotonic_ns()
    progressed = time.monotonic()

    def wait_until(t_ns: float) -> None:
        left = t_ns - time.monotonic_ns()
        if left > 0:
            time.sleep(left / 1e9)

    def forward(out: Any) -> None:  # a step's duration, predicted from its tokens, from schedule() on
        tokens = out.total_num_scheduled_tokens
        # a decoding request is scheduled one token a step (no speculative decoding in a replay)
        prefill = sum(n for n in out.num_scheduled_tokens.values() if n > 1)
        wait_until(t + model.step_ns(prefill, tokens - prefill))

    while i < n or engine.has_work():
        now = time.monotonic_ns() - start
        if i < n and not engine.has_work() and pending[i].queued_ns > now:  # idle until the next arrival
            time.sleep((pending[i].queued_ns - now) / 1e9)
            now = time.monotonic_ns() - start
        # The clock read again after each request queued: one that came due while others were being
        # queued belongs to this step boundary too.
        while i < n and pending[i].queued_ns <= now:
            r = pending[i]
            engine.add(r.request_id, sequence(r, s.block_size, VOCAB), r.prompt_tokens, r.output_tokens)
            i += 1
            now = time.monotonic_ns() - start
        t = time.monotonic_ns()
        scheduled = engine.step(forward)
        progressed = _check_stall(engine, scheduled, progressed, session_dir)
        wait_until(time.monotonic_ns() + model.gap_ns)
        if progress and engine.steps % 100 == 0:
            print(f"\rreplay: step {engine.steps:,}, {i:,}/{n:,} requests queued, "
                  f"{(time.monotonic_ns() - start) / 1e9:.1f} s", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
