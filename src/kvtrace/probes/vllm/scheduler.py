"""Scheduler probe (EngineCore): one row per step, one per (step, request) scheduled, request
lifecycle events, preemptions and holds.

Patch points (`vllm.v1.core.sched.scheduler.Scheduler`, vLLM 0.26 to 0.33): `schedule` (a step starts;
its output is tagged with our step id so the worker can read it), `update_from_output` (the step ends;
first tokens), `add_request` (arrival), `_preempt_request`, `_free_request` (finish, connector holds),
`_free_blocks` (a held request's blocks are released; wrapped from the first hold on), and for why
admission stopped `KVCacheManager.allocate_slots` with the admission hook (`ADMISSION_HOOK`: vLLM 0.32's
`_handle_blocked_waiting_request`, or 0.26-0.27's `_select_waiting_queue_for_scheduling` and
`_try_promote_blocked_waiting_request`; without either the probe runs `degraded`).

Cost: a step schedules up to max_num_seqs requests, so nothing here may do Python work per running
request beyond its `step_requests` row. Decode rows (the common case) are not tuples: one call per step
hands the SchedulerOutput's own lists to a `DecodeLog` (record/buffers.py, native in `_columns.c` where
it builds), which keeps them as runs (a request's consecutive decode steps: one `decode_runs` row
each, ~20x fewer rows than one per step; ingest expands them into step_requests) and hands them to the
recorder as one RecordBatch every ~1 s (buffers.FLUSH_NS): no object per row, no garbage collections they would
trigger, no transposition by the writer. Only
requests in a prefill (new, resumed, or whose prompt is still being chunked: `prefill_chunks`) take the
per-request path. `update_from_output` looks only at the requests whose prefill completed in that step
(first tokens), never at every output. The wrappers keep vLLM's parameter lists (`exact_wrapper`), so
vLLM's calls through them stay specialised. Where `_columns.c` builds, a step in which every request
decodes (the usual step of a busy engine) skips `on_schedule` and `after_update` altogether: a `StepRows`
makes the same rows in C (`record/_columns.c`; the Python methods are the reference, and run every other
step). Under an engine, vLLM's work between two steps evicts the probe's bytecode and data from the
caches, and the ~300 bytecodes of those two methods cost several times what they do warm.

`allocate_slots`, called once per running request per step, is not wrapped at class level (a wrapper
there cost ~2.3% of a scheduling step). For the kv-insuf check, the scheduler's `kv_cache_manager`
attribute is a stand-in (`_AdmissionWatch`) only while a waiting request is being admitted: from
`_handle_blocked_waiting_request`, which vLLM calls first for every waiting request it considers, until
that request's allocate_slots has answered (or schedule() returns); 0.26-0.27 arm it when the queue
is picked for the request. Neither an instance attribute on the manager (it stops CPython specialising every
`kvm.allocate_slots` lookup, see `_AdmissionWatch`) nor `kvm.__dict__` (reading an instance's `__dict__`
materialises it and slows every attribute access on the object afterwards: CPython 3.11 inline values,
measured ~2% of a step). See bench/bench_host_probes.py.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from itertools import repeat
from operator import attrgetter, is_not, methodcaller
from typing import Any

from kvtrace.probes.base import (
    Hook,
    Probe,
    after_call,
    before_call,
    exact_wrapper,
    patch_exact,
    request_lengths_are_fields,
    returns_field_of_field,
)
from kvtrace.record.buffers import decode_log, positions, step_rows
from kvtrace.record.clocks import clock_pair
from kvtrace.record.context import ctx

_now = time.monotonic_ns
# False: every step through the Python methods, also where StepRows is built (tests compare the two)
NATIVE_STEPS = True
SCHED = "vllm.v1.core.sched.scheduler"
KVM = "vllm.v1.core.kv_cache_manager"

try:  # optional: NVTX ranges so an Nsight capture of the same run lines up with ours
    from kvtrace.probes import nvtx_ranges as _nvtx
except Exception:  # pragma: no cover - the module is optional
    _nvtx = None


# The watch stands in for the KVCacheManager from the moment vLLM considers a waiting request until
# that request's allocate_slots has answered (the watch's own allocate_slots puts the manager back), or
# schedule() returns. Where it is armed, and how a blocked request is seen, differ between releases:
ARM_WATCH = """
        try:
            kvm = {self}.kv_cache_manager
            if kvm is probe.watchable or probe.may_watch(kvm):
                set_watched(probe.watch, kvm)
                {self}.kv_cache_manager = probe.watch
                probe.armed = {self}
        except Exception as exc:
            probe.fail(exc)"""
ADMISSION_HOOK = Hook(
    "admission", (
        # vLLM 0.32: called first for every waiting request considered; False = skipped as blocked.
        ((SCHED, "Scheduler._handle_blocked_waiting_request", ("request",)),),
        # vLLM 0.26-0.27: the queue is picked first for every waiting request considered; a blocked
        # request is one whose promotion fails.
        ((SCHED, "Scheduler._select_waiting_queue_for_scheduling", ()),
         (SCHED, "Scheduler._try_promote_blocked_waiting_request", ("request",))),
    ),
    required=False,
    lost="why admission stopped: kv-insuf and blocked are not told apart from the other reasons")
# Streaming-input sessions (vLLM 0.26 and later; a `resumable` request): a turn that stops leaves the
# request waiting for its next input chunk (`_handle_stopped_request` returns False) instead of
# finishing; the next chunk comes as `add_request` with the same id and is merged into the session by
# `_update_request_as_session`, which queues it again (0.33 re-enqueues it later, from
# update_from_output). A vLLM without them has nothing to patch and loses nothing.
STREAMING_HOOK = Hook(
    "streaming", (
        ((SCHED, "Scheduler._handle_stopped_request", ("request",)),
         (SCHED, "Scheduler._update_request_as_session", ("session", "update"))),
        (),
    ),
    required=False,
    lost="streaming-input sessions: where a turn ends and the next is queued (turn_end, queued rows)")
STREAMING_BODIES = {
    "_handle_stopped_request": """
    turn = None
    if probe.enabled and request.resumable:
        try:  # the turn's outputs before vLLM folds them into the session's prompt
            turn = probe.turn_end_row(request)
        except Exception as exc:
            probe.fail(exc)
    finished = {call}
    if turn is not None and not finished:  # (a finished session gets its `finished` row instead)
        probe.req_events.append(turn)
    return finished""",
    "_update_request_as_session": """
    result = {call}
    if probe.enabled:
        try:
            rid = session.request_id
            probe.req_events.append((_now(), ctx.step, rid, "queued", session.num_prompt_tokens, None))
            probe.awaiting_first_token.add(rid)  # the next turn's first token
            probe.prefill_chunks.pop(rid, None)
        except Exception as exc:
            probe.fail(exc)
    return result""",
}
ADMISSION_BODIES = (
    {"_handle_blocked_waiting_request": """
    ready = {call}
    if not ready and not probe.seen:
        probe.seen = "blocked"
    elif probe.armed is None and probe.enabled:""" + ARM_WATCH + """
    return ready"""},
    {"_select_waiting_queue_for_scheduling": """
    queue = {call}
    if probe.armed is None and probe.enabled:""" + ARM_WATCH + """
    return queue""",
     "_try_promote_blocked_waiting_request": """
    ready = {call}
    if not ready and not probe.seen:
        probe.seen = "blocked"
    return ready"""},
)


class SchedulerProbe(Probe):
    name = "scheduler"

    @classmethod
    def targets(cls):
        return [
            (SCHED, "Scheduler.schedule", ()),
            (SCHED, "Scheduler.update_from_output", ("scheduler_output", "model_runner_output")),
            (SCHED, "Scheduler.add_request", ("request",)),
            (SCHED, "Scheduler._preempt_request", ("request",)),
            (SCHED, "Scheduler._free_request", ("request",)),
            (SCHED, "Scheduler._free_blocks", ("request",)),
            ("vllm.v1.engine.core", "EngineCore.shutdown", ()),
            (KVM, "KVCacheManager.allocate_slots", ("request", "num_new_tokens")),
        ]

    @classmethod
    def hooks(cls):
        return [*super().hooks(), ADMISSION_HOOK, STREAMING_HOOK]

    def install_patches(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        global _LENS, _FREE_BLOCKS
        _LENS = request_lengths_are_fields()
        _QUEUE_LENGTHS.update(queue_lengths())
        from vllm.v1.core.block_pool import BlockPool

        fields = returns_field_of_field(BlockPool.get_num_free_blocks, "free_block_queue", "num_free_blocks")
        _FREE_BLOCKS = attrgetter("free_block_queue.num_free_blocks") if fields else methodcaller("get_num_free_blocks")
        # the same read in the wrappers' source (decode_call), where it is specialised bytecode
        free_blocks_read = "free_block_queue.num_free_blocks" if fields else "get_num_free_blocks()"

        self.steps = self.rec.buffer("steps")
        self.step_reqs = self.rec.buffer("step_requests")
        self.req_events = self.rec.buffer("request_events")
        self.preempts = self.rec.buffer("preemptions")
        self.pins = self.rec.buffer("pins")
        # Prompt and output token ids: only when the user asked (--record-tokens); None otherwise.
        self.token_rows = self.rec.buffer("request_tokens") if self.options.get("record_tokens") else None
        self.pending_steps: dict[int, list] = {}  # step -> row awaiting update_from_output
        self.decode_log = decode_log()
        self.awaiting_first_token: set[str] = set()
        # Requests whose prefill is not complete yet -> index of their next prefill chunk. A request
        # leaves when a chunk reaches its num_tokens, is preempted (its recompute starts at 0) or ends.
        self.prefill_chunks: dict[str, int] = {}
        # step -> [(request_id, Request)] whose prefill completed in that step and that have produced
        # no token yet: update_from_output of that step gives them their first token.
        self.first_token_due: dict[int, list] = {}
        self.finished_in_update = 0  # _free_request calls during the current update_from_output
        self.armed: Any = None  # the Scheduler whose kv_cache_manager is the watch right now
        self.watchable: Any = None  # the last KVCacheManager found fit for the watch (may_watch)
        self.held: set[str] = set()  # requests whose blocks a connector holds after finish
        self.releases_watched = False  # `_free_blocks` wrapped (watch_releases), at the first hold
        # What this step's admission showed, strongest first: "kv-insuf" (allocate_slots returned None
        # for a waiting request), a prefill hold ("prefill-throttle", "prefill-cadence": prefill_hold,
        # set before the call), "blocked" (a waiting request was skipped as blocked), or None. One
        # attribute, not three: see test_probe_attributes_stay_inline_values.
        self.seen: str | None = None
        self.preempted_this_step = 0
        self.config_recorded = False
        self.inject = self.options.get("inject_fault") == self.name
        self.nvtx_depth = 0  # NVTX ranges this thread has open (step, phase)
        if _nvtx is not None:
            _nvtx.configure(enabled=bool(self.options.get("nvtx", True)),
                            layers=bool(self.options.get("nvtx_layers", False)))
        self.nvtx_on = _nvtx is not None and _nvtx.enabled()
        probe = self

        def shutdown(orig):
            # Scheduling is over when EngineCore shuts down, but the front end's process manager
            # force-kills it a few seconds later (waiting for workers can take that long), before
            # atexit runs: finish the recording first, while it is safe.
            def wrapper(core, *args, **kwargs):
                try:
                    from kvtrace.probes.lifecycle import close_all

                    close_all()
                except Exception as exc:
                    probe.fail(exc)
                return orig(core, *args, **kwargs)
            return wrapper

        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.engine.core import EngineCore

        self.patch(EngineCore, "shutdown", shutdown)
        # The kv-insuf watch (may_watch): a stand-in for the KVCacheManager whose allocate_slots
        # notes a failed admission, made once with vLLM's own parameters, and forwards to the real one.
        alloc_plain = KVCacheManager.allocate_slots
        watch_alloc = exact_wrapper(alloc_plain, """
    self = self._kvm  # the watch stands in for the real manager: call vLLM's method on that
    blocks = {call}
    sched = probe.armed
    if sched is not None:  # the answer is in: the real manager back until the next waiting request
        sched.kv_cache_manager = self
        probe.armed = None
    # None for a request that is not running = admission stopped for lack of KV blocks.
    if blocks is None and request.status.name != "RUNNING":
        probe.seen = "kv-insuf"  # outranks what was seen before
    return blocks""", {"probe": self})
        # vLLM's own allocate_slots is kept on the watch's class (for may_watch), under a name no
        # manager attribute has (every name on the watch shadows the manager's), not on the probe:
        # CPython 3.11 keeps at most 29 instance attributes as inline values; with a 30th, every
        # `probe.x` in the wrappers reads a materialised dict (test_probe_attributes_stay_inline_values).
        self.watch = type("AdmissionWatch", (_AdmissionWatch,),
                          {"allocate_slots": watch_alloc, "_kvtrace_vllm_allocate_slots": alloc_plain})()
        # The wrappers run once per step (schedule, update_from_output) or per request (the rest). As
        # `exact_wrapper`s, vLLM's calls through them stay specialised Python calls (a `*args, **kwargs`
        # wrapper costs an argument tuple, a dict and a C-level call each time). Each body names
        # vLLM's own parameters (checked by `targets()`); `{call}` calls the original.
        env = self.wrapper_env()
        # A step that only decodes: its rows in C where StepRows is built (None: the Python methods)
        env["rows"] = rows = step_rows(self, self.decode_log, self.steps, ctx, _QUEUE_LENGTHS) if NATIVE_STEPS else None
        on_schedule = "probe.on_schedule({self}, out, t0)"
        after_update = "probe.after_update({self}, step)"
        if rows is not None:
            on_schedule = decode_call(free_blocks_read) + " or " + on_schedule
            after_update = "rows.end({self}, step, probe.finished_in_update, {self}.running) or " + after_update
        # vLLM 0.32+'s schedule(throttle_prefills=...), passed to prefill_hold by name where it exists
        # (`locals()` would build the wrapper's frame object and a dict of its locals every step)
        throttle = "throttle_prefills" if "throttle_prefills" in inspect.signature(Scheduler.schedule).parameters \
            else "False"
        # prefill_hold's usual answer, None, without its call where this vLLM has no prefill cadence
        # (0.33's `local_prefill_interval`): then only a throttled step asks it
        hold = "probe.prefill_hold({self}, {throttle})"
        if not has_prefill_cadence(Scheduler):
            hold = "None" if throttle == "False" else f"({hold} if {throttle} else None)"
        patch_exact(self, Scheduler, {
            "schedule": """
    if not probe.enabled:
        return {call}
    t0 = _now()
    probe.preempted_this_step = 0
    try:
        probe.seen = {hold}
    except Exception as exc:
        probe.seen = None
        probe.fail(exc)
    ctx.step = {self}.current_step + 1  # schedule() increments it first thing
    if probe.nvtx_on:
        try:
            probe.nvtx_open(ctx.step, "schedule")
        except Exception as exc:
            probe.fail(exc)
    try:
        out = {call}
    finally:
        if probe.armed is not None:
            try:
                probe.disarm_admission()
            except Exception as exc:  # never into vLLM
                probe.fail(exc)
    try:
        if probe.nvtx_on:
            probe.nvtx_close(keep_step=True)
        {on_schedule}
    except Exception as exc:
        probe.fail(exc)
    return out""".replace("{hold}", hold).replace("{throttle}", throttle).replace("{on_schedule}", on_schedule),
            "update_from_output": """
    if not probe.enabled:
        return {call}
    step = getattr(scheduler_output, "_kvtrace_step", ctx.step)
    ctx.step = step
    if probe.nvtx_on:
        try:
            probe.nvtx_open(None, "update")
        except Exception as exc:
            probe.fail(exc)
    probe.finished_in_update = 0
    result = {call}
    try:
        if probe.nvtx_on:
            probe.nvtx_close(keep_step=False)
        {after_update}
    except Exception as exc:
        probe.fail(exc)
    return result""".replace("{after_update}", after_update),
            # Arrival and queued rows, inline: a handler call per request cost about as much as its rows.
            "add_request": """
    if probe.enabled:
        try:
            t = _now()
            rid = request.request_id
            step, prompt = ctx.step, request.num_prompt_tokens
            events = probe.req_events
            if rid in {self}.requests:  # a streaming-input session's next chunk (or its end: not resumable)
                if getattr(request, "resumable", False):
                    events.append((t, step, rid, "input", prompt, None))
            else:
                # vLLM stamps arrival with time.time(); its age now, in wall time, is placed before a
                # monotonic time read with it (one pair: a pause between two separate reads would be
                # counted as age). An offset taken once at start would drift with the wall clock (NTP
                # slews it), putting arrivals after the rows they precede; a clock stepped back gives 0.
                mono_ns, wall_ns = _clock_pair()
                age_ns = max(0, wall_ns - int(request.arrival_time * 1e9))
                events.append((min(t, mono_ns - age_ns), step, rid, "arrival", prompt, None))
                events.append((t, step, rid, "queued", prompt, None))
                probe.awaiting_first_token.add(rid)
            if probe.token_rows is not None:  # only when the user asked (--record-tokens)
                probe.token_rows.append((t, rid, "prompt", list(request.prompt_token_ids or ())))
        except Exception as exc:
            probe.fail(exc)
    return {call}""",
            "_preempt_request": """
    if not probe.enabled:
        return {call}
    before = None
    try:
        before = (request.num_computed_tokens, num_blocks({self}, request.request_id))
    except Exception as exc:
        probe.fail(exc)
    result = {call}
    if before is not None and probe.enabled:
        try:
            probe.on_preempt(request, *before)
        except Exception as exc:
            probe.fail(exc)
    return result""",
            "_free_request": after_call("probe.on_finished({self}, request)"),
        }, env)
        admission = self.variant(ADMISSION_HOOK.name)
        if admission is not None:
            patch_exact(self, Scheduler, ADMISSION_BODIES[admission], env)
        if self.variant(STREAMING_HOOK.name) == 0:
            patch_exact(self, Scheduler, STREAMING_BODIES, env)

    def wrapper_env(self) -> dict:
        """The names the Scheduler wrappers' bodies use besides vLLM's parameters."""
        return {"probe": self, "ctx": ctx, "_now": _now, "_clock_pair": clock_pair, "num_blocks": _num_blocks, "set_watched": _set_watched}

    def after_update(self, sched: Any, step: int) -> None:
        """The step ends: its row, and the first tokens of the requests whose prefill completed in it."""
        t = _now()
        row = self.pending_steps.pop(step, None)
        due = self.first_token_due.pop(step, None)
        if due:
            awaiting = self.awaiting_first_token
            for rid, req in due:
                # Tokens the request holds after this update: it had none before this step.
                n = len(req._output_token_ids) if _LENS else req.num_output_tokens
                if n and rid in awaiting:
                    awaiting.discard(rid)
                    self.req_events.append((t, step, rid, "first_token", n, None))
        if row is not None:
            row[3] = t
            row[19] = self.finished_in_update
            self.steps.append(tuple(row))
        if not sched.running and not sched.has_requests():
            # (`running` first: while requests run the engine is busy, and has_requests() is four of
            # vLLM's calls, ~1.5 us a step. An engine paused with requests running keeps its rows until
            # the next hand-over.)
            self.went_idle()

    @staticmethod
    def went_idle() -> None:
        """The engine goes idle (it blocks on its input queue next): rows held as columns would otherwise
        wait there for the next request, or be lost to a kill."""
        from kvtrace.probes.lifecycle import take_pending

        take_pending()

    # ---- kv-insuf: allocate_slots seen only while the waiting queue is admitted ---------------
    def may_watch(self, kvm: Any) -> bool:
        """May the watch stand in for this KVCacheManager (asked once per manager; the wrapper of
        `_handle_blocked_waiting_request` arms it)? Not when the manager has its own allocate_slots (an
        instance attribute, or a class with its own method): that one would be bypassed."""
        if getattr(kvm.allocate_slots, "__func__", None) is not type(self.watch)._kvtrace_vllm_allocate_slots:
            return False
        self.watchable = kvm
        return True

    def disarm_admission(self) -> None:
        sched, self.armed = self.armed, None
        if sched.kv_cache_manager is self.watch:
            sched.kv_cache_manager = self.watch._kvm
        _set_watched(self.watch, None)

    def uninstall(self) -> None:
        if getattr(self, "armed", None) is not None:
            self.disarm_admission()
        self.watchable = None
        super().uninstall()

    # ---- NVTX: `kvtrace step N` from schedule() to the end of update_from_output() -------------
    def nvtx_open(self, step: int | None, phase: str) -> None:
        if _nvtx is None or not _nvtx.enabled():
            return
        if step is not None:
            while self.nvtx_depth:  # a step whose update never came (pipelined engines): close it
                _nvtx.pop()
                self.nvtx_depth -= 1
            _nvtx.push_step(step)
            self.nvtx_depth += 1
        _nvtx.push_phase(phase)
        self.nvtx_depth += 1

    def nvtx_close(self, keep_step: bool) -> None:
        if _nvtx is None or not _nvtx.enabled():
            return
        while self.nvtx_depth > (1 if keep_step else 0):
            _nvtx.pop()
            self.nvtx_depth -= 1

    # ---- event handlers (EngineCore process, scheduler thread) --------------------------------
    def on_schedule(self, sched: Any, out: Any, t0: int) -> None:
        if self.inject:
            self.maybe_inject_fault()
        t1 = _now()
        step = sched.current_step
        ctx.step = step
        try:
            out._kvtrace_step = step  # travels with the output to the worker (pickled attribute)
        except AttributeError:
            pass
        if not self.config_recorded:
            self.record_engine_config(sched)
        requests = sched.requests
        num_sched = out.num_scheduled_tokens
        rows = self.step_reqs
        events = self.req_events
        prefill_tokens = prompt_new = cached_new = 0
        # The step's prefill rows, new requests first: (request id, Request, tokens, computed before,
        # new blocks, kind); their chunk index is worked out below, in one loop.
        prefills = []
        for new in out.scheduled_new_reqs:
            rid = new.req_id
            req = requests.get(rid)
            computed = new.num_computed_tokens
            prompt_new += req.num_prompt_tokens if req is not None else 0
            cached_new += computed
            prefills.append((rid, req, num_sched.get(rid, 0), computed, len(new.block_ids[0]) if new.block_ids else 0,
                             "new"))
            events.append((t1, step, rid, "scheduled", computed, None))
        cached = out.scheduled_cached_reqs
        ids = cached.req_ids
        chunks = self.prefill_chunks
        num_resumed = 0
        at: list[int] = []
        if ids:
            resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
            slow = resumed_ids  # rows that are prefills; every other cached request decodes
            if chunks:
                mid = [rid for rid in chunks if rid in num_sched]  # few: prompts being chunked
                if mid:
                    slow = set(resumed_ids).union(mid)
            comps, new_ids = cached.num_computed_tokens, cached.new_block_ids
            if slow:
                # Few rows are prefills: find their positions without a Python loop over every
                # running request (~70 us a step); every other row decodes.
                at = positions(ids, slow)
                for i in at:
                    rid = ids[i]
                    computed = comps[i]
                    nb = new_ids[i]
                    kind = "running"
                    if rid in resumed_ids:
                        kind = "resumed"
                        num_resumed += 1
                        chunks.pop(rid, None)  # the recompute is a new prefill, from chunk 0
                        events.append((t1, step, rid, "resumed", computed, None))
                    prefills.append((rid, requests.get(rid), num_sched[rid], computed, len(nb[0]) if nb else 0, kind))
        if prefills:
            # Each prefill's chunk index, and whether its request is still prefilling after it (inline:
            # a method call per row cost more than the rest of the row).
            awaiting = self.awaiting_first_token
            for rid, req, tokens, computed, blocks, kind in prefills:
                chunk = chunks.get(rid, 0)
                if req is not None and computed + tokens < (len(req._all_token_ids) if _LENS else req.num_tokens):
                    chunks[rid] = chunk + 1
                else:  # the prompt (or the recompute) is complete: decode from the next step
                    chunks.pop(rid, None)
                    if rid in awaiting and req is not None:
                        self.first_token_due.setdefault(step, []).append((rid, req))
                rows.append((step, rid, tokens, "prefill", chunk, computed, blocks, kind))
                prefill_tokens += tokens
        prefill_reqs = len(prefills)
        if ids:
            decoding = len(ids) - len(at)
            if decoding:
                # Every scheduled request has >= 1 token (prefill_tokens counts all the others): the
                # decode rows' total says whether each has exactly 1, the usual case.
                ones = out.total_num_scheduled_tokens - prefill_tokens == decoding
                if self.decode_log.add(step, ids, comps, new_ids, at or None, None if ones else num_sched):
                    self.take()
        total = out.total_num_scheduled_tokens
        decode_reqs = len(num_sched) - prefill_reqs
        pool = sched.kv_cache_manager.block_pool
        blocks_total = pool.num_gpu_blocks - 1  # block 0 is the null block
        blocks_used = blocks_total - _FREE_BLOCKS(pool)
        # Waiting: vLLM's queue, and those holding KV blocks (0.32+) or passed over (0.26-0.27's own queue).
        waiting, holding = sched.waiting, getattr(sched, "kv_holding_waiting", None)
        if holding is None:
            holding = getattr(sched, "skipped_waiting", ())
        num_waiting = _QUEUE_LENGTHS.get(type(waiting), len)(waiting) + _QUEUE_LENGTHS.get(type(holding), len)(holding)
        budget = sched.max_num_scheduled_tokens
        self.pending_steps[step] = [
            step, t0, t1, None, total, prefill_tokens, total - prefill_tokens, prefill_reqs,
            decode_reqs, len(sched.running), num_waiting, blocks_used, blocks_total, budget,
            sched.max_num_running_reqs, self._admission_stop(sched, total, budget, num_waiting),
            self.preempted_this_step, len(out.scheduled_new_reqs), num_resumed, 0, prompt_new,
            cached_new,
        ]

    @staticmethod
    def prefill_hold(sched: Any, throttle: bool) -> str | None:
        """Whether schedule() will hold this step's prefills back, by vLLM's own test, read before the
        call: "prefill-throttle" (data-parallel balancing, `schedule(throttle_prefills=True)`, 0.32+),
        "prefill-cadence" (0.33's `prefill_schedule_interval`: prefills wait until that many steps have
        passed since the last one that carried a prefill), else None. Both need a decoding request
        in the batch; both stop when the last release step could not drain the queue."""
        interval = getattr(sched, "local_prefill_interval", 1)
        if not throttle and interval <= 1:
            return None  # the usual case: one attribute read a step
        if getattr(sched, "prefill_capacity_bound", False):
            return None
        if throttle:
            reason = "prefill-throttle"
        elif (sched.num_executed_steps + 1) - sched.last_prefill_step < interval:
            reason = "prefill-cadence"
        else:
            return None
        return reason if any(not r.is_prefill_chunk for r in sched.running) else None

    def _admission_stop(self, sched: Any, total: int, budget: int, num_waiting: int) -> str:
        """Why the waiting queue stopped being admitted this step (see vllm-hook-map.md)."""
        if self.preempted_this_step:
            return "preempted"  # a step that preempted skips the waiting queue entirely
        seen = self.seen
        if seen == "kv-insuf":
            return seen
        if num_waiting == 0:
            return "none"
        if seen is not None and seen.startswith("prefill-"):
            return seen
        if total >= budget:
            return "tok-budget"
        if len(sched.running) >= getattr(sched, "max_num_active_reqs", sched.max_num_running_reqs):
            return "max-seqs"
        if seen == "blocked":
            return seen
        if sched.lora_config is not None:
            return "lora"
        # vLLM passes over a waiting request it cannot schedule now (its KV still loading, stale output
        # in flight, nothing to compute yet: 0.33 adds this one) and goes on to the next; those passed
        # over are in `deferred_waiting` (0.32+) or their own queue (`skipped_waiting`, 0.26-0.27).
        # All that still wait were passed over: the queue did not stop.
        deferred = getattr(sched, "deferred_waiting", None)
        if deferred is None:
            deferred = getattr(sched, "skipped_waiting", None)
        if deferred is not None and len(deferred) >= num_waiting:
            return "skipped"
        # Chunked prefill off and the next prompt does not fit the remaining budget.
        return "tok-budget"

    def on_preempt(self, request: Any, computed_before: int, blocks: int) -> None:
        t = _now()
        rid = request.request_id
        self.preempted_this_step += 1
        self.prefill_chunks.pop(rid, None)  # the recompute is a new prefill, from chunk 0
        outputs = len(request._output_token_ids) if _LENS else request.num_output_tokens
        self.preempts.append((t, ctx.step, rid, computed_before, blocks, outputs))
        self.req_events.append((t, ctx.step, rid, "preempted", computed_before, None))

    def turn_end_row(self, request: Any) -> tuple:
        """A streaming-input session's turn stopped (vLLM set its finish status; the session goes on):
        the row, with the turn's output tokens and why it stopped."""
        reason = request.get_finished_reason()
        outputs = len(request._output_token_ids) if _LENS else request.num_output_tokens
        return (_now(), ctx.step, request.request_id, "turn_end", outputs,
                str(reason).split(".")[-1].lower() if reason is not None else request.status.name)

    def on_finished(self, sched: Any, request: Any) -> None:
        t = _now()
        rid = request.request_id
        status = request.status
        reason_name = _REASON_NAMES.get(status)
        if reason_name is None:  # first finish with this status: ask vLLM (two of its calls)
            reason = request.get_finished_reason()
            reason_name = str(reason).split(".")[-1].lower() if reason is not None else status.name
            if reason is not None:
                _REASON_NAMES[status] = reason_name
        self.finished_in_update += 1
        self.awaiting_first_token.discard(rid)
        self.prefill_chunks.pop(rid, None)
        outputs = len(request._output_token_ids) if _LENS else request.num_output_tokens
        self.req_events.append((t, ctx.step, rid, "finished", outputs, reason_name))
        if self.token_rows is not None:
            self.token_rows.append((t, rid, "output", list(request.output_token_ids)))
        # A connector may delay the free (request_finished returned True): the KV is held, and vLLM
        # keeps the request until `_free_blocks` (a request freed at once is gone from `requests`).
        blocks = _block_ids(sched, rid) if rid in sched.requests else None
        if blocks:
            if not self.releases_watched:
                self.watch_releases()
            self.held.add(rid)
            self.pins.append((t, ctx.step, "hold", rid, blocks, None, "connector-delay-free"))

    def watch_releases(self) -> None:
        """Wrap `Scheduler._free_blocks`, which ends a hold, from the first hold on: vLLM calls it for
        every request that finishes, and only requests a connector holds need it."""
        from vllm.v1.core.sched.scheduler import Scheduler

        self.releases_watched = True
        patch_exact(self, Scheduler, {
            "_free_blocks": before_call("probe.on_release({self}, request)",
                                        " and request.request_id in probe.held"),
        }, self.wrapper_env())

    def on_release(self, sched: Any, request: Any) -> None:
        rid = request.request_id
        self.held.discard(rid)
        self.pins.append((_now(), ctx.step, "release", rid, _block_ids(sched, rid), None,
                          "connector-delay-free"))

    def record_engine_config(self, sched: Any) -> None:
        self.config_recorded = True
        self.rec.role = "engine"
        # Rows carry rank = dp_rank * 1000 + tp_rank (the scheduler is per DP rank, tp 0).
        self.rec.rank = int(sched.vllm_config.parallel_config.data_parallel_rank or 0) * 1000
        cfg = sched.vllm_config
        sc, cc = cfg.scheduler_config, cfg.cache_config
        pc = cfg.parallel_config
        self.rec.info["engine_config"] = {
            "model": getattr(cfg.model_config, "model", None),
            "block_size": sched.block_size,
            "num_kv_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
            "kv_cache_groups": len(sched.kv_cache_config.kv_cache_groups),
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_num_scheduled_tokens": sched.max_num_scheduled_tokens,
            "max_model_len": getattr(cfg.model_config, "max_model_len", None),
            "enable_prefix_caching": cc.enable_prefix_caching,
            # vLLM 0.33: tokens after each block that its hash covers (0: a block is hashed once full)
            "hash_lookahead_tokens": int(getattr(sched, "num_hash_lookahead_tokens", 0) or 0),
            "enable_chunked_prefill": sc.enable_chunked_prefill,
            "data_parallel_rank": pc.data_parallel_rank,
            "data_parallel_size": pc.data_parallel_size,
            "tensor_parallel_size": pc.tensor_parallel_size,
            "kv_connector": getattr(cfg.kv_transfer_config, "kv_connector", None)
            if cfg.kv_transfer_config else None,
            "scheduler_cls": str(getattr(sc, "scheduler_cls", None)),
        }

    def take(self) -> None:
        """Hand the decode rows held as runs to the recorder (also called when the engine goes idle)."""
        cols = self.decode_log.take()
        if cols is not None:
            self.rec.append_columns("decode_runs", cols)

    def close(self) -> None:
        """Steps whose update_from_output never came (engine stopped) are kept, with no end time."""
        for row in list(self.pending_steps.values()):
            self.steps.append(tuple(row))
        self.pending_steps.clear()
        self.first_token_due.clear()
        self.take()


class _AdmissionWatch:
    """Stands in for the scheduler's KVCacheManager while vLLM admits a waiting request (from
    `_handle_blocked_waiting_request` until its allocate_slots answers): the probe's `allocate_slots`
    (set on a subclass made at install) notes an admission that failed for lack of KV blocks and puts
    the real manager back; every other attribute is the real manager's, read through a forwarding
    property (made at the first read of each name). Reads through the watch cost ~10x a plain
    attribute read (no specialisation), so the window is kept to the one call that answers.

    Why a stand-in and not an instance attribute `allocate_slots` on the manager: once that name has been
    an instance attribute, CPython 3.11 no longer specialises `kvm.allocate_slots` lookups anywhere (an
    instance might shadow the method), and vLLM looks it up once per running request per step, through a
    generic path that is cold in the caches (~50 k lookups a round in bench_host_probes; callgrind's
    cache simulation counted +0.16 M instruction-cache and +0.5 M data-cache misses). Swapping the
    scheduler's own `kv_cache_manager` attribute changes no object's set of attribute names.
    """

    __slots__ = ("_kvm",)

    def __getattr__(self, name: str) -> Any:
        # The first read of `name` through the watch installs a forwarding property on its class, so
        # the later ones never come here: on CPython 3.11, __getattr__ runs only after the normal
        # lookup has raised an AttributeError with a formatted message (~3,000 instructions), and vLLM
        # reads a few of the manager's names per waiting request (~2,600 a round in the benchmark).
        if name == "_kvm":  # not armed: no manager to forward to
            raise AttributeError(name)
        if not name.startswith("__"):
            setattr(type(self), name, property(attrgetter("_kvm." + name)))
        return getattr(self._kvm, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._kvm, name, value)


# Sets the watch's own `_kvm` slot (its __setattr__ forwards every name to the manager).
_set_watched = _AdmissionWatch._kvm.__set__

# Whether vLLM's Request.num_tokens / num_output_tokens are `len()` of its token-id lists (base.is_len_of):
# the handlers then read the lists' lengths, not the properties. Set at install.
_LENS = False

def has_prefill_cadence(scheduler_cls: Any) -> bool:
    """Whether this vLLM's Scheduler may hold prefills back by cadence (0.33's `local_prefill_interval`);
    True where its source cannot be read (prefill_hold then asks every step)."""
    try:
        return "local_prefill_interval" in inspect.getsource(scheduler_cls)
    except (OSError, TypeError):
        return True


def decode_call(free_blocks_read: str) -> str:
    """The schedule wrapper's call of `StepRows.decode` (record/_columns.c), with the attributes it needs
    read here, in the wrapper: a read in bytecode is specialised to the object's layout and touches only
    the lines vLLM's own reads of those objects have just brought in, where the same read from C looks the
    name up in the type's method cache and the instance's keys (18 reads with the caches cold: 9.5 us from
    C against 3.3 us here, the CPU machine). Attributes some vLLM releases lack are passed as None, and
    looked up in C: `resumed_req_ids` (None: none resumed), the holding queue (`kv_holding_waiting`, or
    0.26-0.27's `skipped_waiting`)."""
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.core.sched.scheduler import Scheduler

    resumed = "_cached.resumed_req_ids" if "resumed_req_ids" in getattr(CachedRequestData, "__dataclass_fields__", ()) \
        else "None"
    holding = "None"
    try:
        init = inspect.getsource(Scheduler.__init__)
    except (OSError, TypeError):
        init = ""
    for name in ("kv_holding_waiting", "skipped_waiting"):
        if f"self.{name} =" in init or f"self.{name}:" in init:
            holding = "{self}." + name
            break
    return ("rows.decode({self}, out, t0, out.scheduled_new_reqs, (_cached := out.scheduled_cached_reqs).req_ids, "
            f"{resumed}, _cached.num_computed_tokens, _cached.new_block_ids, out.num_scheduled_tokens, "
            "out.total_num_scheduled_tokens, {self}.current_step, "
            f"(_pool := {{self}}.kv_cache_manager.block_pool).{free_blocks_read}, _pool.num_gpu_blocks, "
            f"{{self}}.waiting, {holding}, {{self}}.max_num_scheduled_tokens, {{self}}.running, "
            "{self}.max_num_running_reqs, probe.preempted_this_step, probe.seen)")


# The free blocks of a BlockPool: its get_num_free_blocks(), or the attribute that method returns
# (returns_field_of_field). Set at install.
_FREE_BLOCKS: Any = methodcaller("get_num_free_blocks")

# Request queue type -> a C function giving its length, for the types whose Python `__len__` only
# returns deque's (queue_lengths): len() of vLLM's FCFSRequestQueue is a Python call and a super()
# (~1-2 us, twice a step). Filled at install.
_QUEUE_LENGTHS: dict = {}


def queue_lengths() -> dict:
    """{vLLM's FCFSRequestQueue: deque.__len__} where its `__len__` is `return super().__len__()` with
    deque next in its MRO; else {} (len() is used)."""
    try:
        from vllm.v1.core.sched.request_queue import FCFSRequestQueue
    except Exception:
        return {}
    code = getattr(FCFSRequestQueue.__len__, "__code__", None)
    if code is not None and code.co_names == ("super", "__len__") and FCFSRequestQueue.__mro__[1] is deque:
        return {FCFSRequestQueue: deque.__len__}
    return {}


# vLLM's finished RequestStatus -> our name of its FinishReason ("stop", "length", ...), made once per
# status: vLLM derives the reason from the status alone (RequestStatus.get_finished_reason).
_REASON_NAMES: dict = {}


def _group0_ids(sched: Any, request_id: str) -> Any:
    """The request's block ids in KV-cache group 0, null blocks (id 0) included; () if none."""
    try:
        groups = sched.kv_cache_manager.get_block_ids(request_id)
    except Exception:
        return ()
    return groups[0] if groups else ()


def _block_ids(sched: Any, request_id: str) -> list[int]:
    return [b for b in _group0_ids(sched, request_id) if b]


def _num_blocks(sched: Any, request_id: str) -> int:
    """Blocks the request holds in KV-cache group 0, less the null block (id 0). Counted on vLLM's own
    list (no KVCacheBlocks and id lists made per preemption, which cost ~250 Python opcodes each;
    `list.count` would call the dataclass's `__eq__` per block); else through its public accessor."""
    kvm = sched.kv_cache_manager
    try:
        blocks = kvm.coordinator.single_type_managers[0].req_to_blocks.get(request_id) or ()
        null = kvm.block_pool.null_block
    except Exception:  # another vLLM's layout
        ids = _group0_ids(sched, request_id)
        return len(ids) - ids.count(0)
    return sum(map(is_not, blocks, repeat(null)))
