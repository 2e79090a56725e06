"""Attention probe (Worker): per-layer KV reads and writes from the metadata the kernels receive.

Patch points (vLLM 0.26 to 0.32):
- the model runner's `execute_model(scheduler_output)`, in each runner whose module the worker loads:
  V1 (`vllm/v1/worker/gpu_model_runner.py`, also the CPU runner's base) and V2
  (`vllm/v1/worker/gpu/model_runner.py`, the default on CUDA). It reads our step id from the
  SchedulerOutput (tagged by the scheduler probe), starts the ring's step, and after the forward pass
  writes which request sat in which batch row (`batch_slots`: V1's `input_batch`, V2's
  `execute_model_state.input_batch`; held as runs of steps with the same batch, `batch_slot_runs`), so
  device records can name requests. A forward pass without a
  step id (warm-up, dummy runs) is not recorded. `capture_model` makes the ring before CUDA graphs are
  captured: its kernels are captured with attention and read the step id from device memory.
- the module-global `get_attention_context(layer_name)` in `model_executor/layers/attention/attention.py`
  (and the name MLA imported): every attention layer calls it for its KV write and again for its read;
  on the read call we hand the layer's slot mapping and the metadata's `block_table`, `seq_lens`,
  `query_start_loc` to the KV access ring (`kvtrace.probes.kv_access`), which records on the device
  (CUDA, CuPy) or on the CPU.
- the metadata builders of backends whose metadata splits the batch into decode and prefill parts or
  plans it into kernel wrappers, keeping no whole-batch block table (MLA's `MLACommonMetadataBuilder`,
  `FlashInferMetadataBuilder`; `TABLE_KEEPERS`): their `build(common_prefix_len, common_attn_metadata)`
  is wrapped to keep the CommonAttentionMetadata it was given on the metadata it returns, and the read
  takes `block_table_tensor`, `seq_lens`, `query_start_loc` from there. Patched when their modules load.
  Metadata with neither makes the probe `unsupported: <class>`: never `attached` with no rows.
Never `Attention.forward`: Dynamo traces it (see vllm-hook-map.md).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from kvtrace.probes.base import Probe, TargetMissing, exact_wrapper
from kvtrace.record.buffers import SlotRuns

ATTN = "vllm.model_executor.layers.attention.attention"
MLA = "vllm.model_executor.layers.attention.mla_attention"
RUNNER = "vllm.v1.worker.gpu_model_runner"  # V1, and the CPU runner's base class
RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"  # Model Runner V2, vLLM's default on CUDA
# The custom ops that call get_attention_context to run attention over the KV cache (a read of the
# step's blocks and the write of its new tokens). vLLM 0.33 adds Step-5's own two; its fused
# norm/rope/KV-insert ops (e.g. fused_qk_norm_rope_kv_insert) only write, ahead of one of these, and are
# left out so a layer's records are not doubled.
READ_CALLERS = ("unified_attention_with_output", "unified_mla_attention_with_output",
                "step5_dsa_attention_with_output", "step5_swa_attention_with_output")
# Builders (module -> class) whose metadata keeps no whole-batch block table: MLA's (every MLA backend's
# builder but the sparse ones derives from it) and FlashInfer's. Their `build` keeps the batch's
# CommonAttentionMetadata on the metadata, under COMMON.
FLASHINFER = "vllm.v1.attention.backends.flashinfer"
TABLE_KEEPERS = {MLA: "MLACommonMetadataBuilder", FLASHINFER: "FlashInferMetadataBuilder"}
COMMON = "_kvtrace_common"
# Forward passes without a step id before the probe says so: a few are warm-up passes (Model Runner V2
# runs ~5 on fake requests) before the first tagged step; this many with none tagged means no tags come.
UNTAGGED_BEFORE_SAYING = 32


def v1_req_ids(runner: Any) -> Any:
    return runner.input_batch.req_ids


def v2_req_ids(runner: Any) -> Any:
    state = runner.execute_model_state  # set by execute_model, cleared by sample_tokens
    return state.input_batch.req_ids if state is not None else ()


# module -> (the runner's class, how to read the batch's request ids after execute_model)
RUNNERS = {RUNNER: ("GPUModelRunner", v1_req_ids), RUNNER_V2: ("GPUModelRunner", v2_req_ids)}

try:
    from kvtrace.probes import nvtx_ranges as _nvtx
except Exception:  # pragma: no cover
    _nvtx = None


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _NullContext()


def layer_index(layer_name: str, cache: dict[str, int]) -> int:
    """`model.layers.12.self_attn.attn` -> 12 (the first integer path component; -1 if none)."""
    idx = cache.get(layer_name)
    if idx is None:
        idx = next((int(p) for p in layer_name.split(".") if p.isdigit()), -1)
        cache[layer_name] = idx
    return idx


class AttentionProbe(Probe):
    name = "attention"

    # The model runners are patched when their modules are imported (probes/imports.py), not at install:
    # importing one costs ~0.6 s, and only worker processes ever load them.
    # The package: importing it loads ATTN with every other attention module (~0.4 s), in a front end
    # that never runs a layer; asking whether ATTN exists would import the package already.
    defer_until = ATTN.rsplit(".", 1)[0]

    @classmethod
    def targets(cls):
        return [(ATTN, "get_attention_context", ("layer_name",))]

    def install_patches(self) -> None:
        import importlib

        from kvtrace.probes.imports import when_imported

        attn_mod = importlib.import_module(ATTN)
        self.ring = None
        self.step = -1
        self.untagged = 0  # forward passes run without a step id (warm-up, dummy runs): not recorded
        self.slots = SlotRuns()  # batch_slots rows, as runs of steps with the same batch
        self.layer_names: dict[str, int] = {}
        self.open_layer_range = False
        # Read once: the layer wrapper runs for every layer of an eager forward pass
        self.inject = self.options.get("inject_fault") == self.name
        self.nvtx_layers = _nvtx is not None and bool(self.options.get("nvtx_layers"))
        granularity = self.options.get("kv_granularity", "timing")
        layers = self.options.get("kv_layers") or ("all" if granularity == "blocks" else "auto")
        sample_every = int(self.options.get("kv_sample_every", 1) or 1)
        probe = self

        # The runner's execute_model, wrapped with its own parameter list (exact_wrapper: vLLM's call and
        # ours stay specialised Python calls). The rare cases (the first passes, warm-up passes without a
        # step id) are in start_pass.
        execute_body = """
    if not probe.enabled:
        return {call}
    step = getattr(scheduler_output, "_kvtrace_step", None)
    try:
        if step is None or probe.step < 0 or probe.ring is None:
            if not probe.start_pass({self}, step, granularity, layers, sample_every):
                return {call}  # a pass without a step id: run unrecorded
        else:
            probe.step = step
            probe.ring.begin_step(step)
    except Exception as exc:
        probe.fail(exc)
        return {call}
    # NVTX ranges only where a profiler listens (asked each step: the scheduler probe may configure the
    # module after this probe installs); else no context manager's two calls a step
    if probe.nvtx_layers or (nvtx is not None and nvtx.enabled()):
        with probe.nvtx_execute():
            try:
                result = {call}
            finally:
                if probe.nvtx_layers:
                    probe.nvtx_layer(None)
    else:
        result = {call}
    if probe.enabled and scheduler_output.total_num_scheduled_tokens:
        try:
            ring = probe.ring
            if ring._state_due:  # the pass ran no ring kernel where the ring could see it
                ring.state_missed()
            # a row per (step, slot) was 7.5-19 us a step at 256 requests (bench/bench_batch_slots.py); a
            # decode batch keeps its rows for many steps, kept once
            if probe.slots.add(step, req_ids({self})):
                probe.take()
        except Exception as exc:
            probe.fail(exc)
    return result"""

        def execute_model(orig, req_ids):
            env = {"probe": probe, "nvtx": _nvtx, "req_ids": req_ids, "granularity": granularity,
                   "layers": layers, "sample_every": sample_every}
            return exact_wrapper(orig, execute_body, env)

        def get_attention_context(orig):
            def wrapper(layer_name, *args, **kwargs):
                result = orig(layer_name, *args, **kwargs)
                ring = probe.ring
                if ring is None or not probe.enabled:
                    return result
                caller = sys._getframe(1).f_code.co_name
                if caller in READ_CALLERS:
                    meta = result[0]
                    if meta is not None:
                        try:
                            if probe.inject:
                                probe.maybe_inject_fault()
                            layer = layer_index(layer_name, probe.layer_names)
                            if probe.nvtx_layers:
                                probe.nvtx_layer(layer)
                            # The layer's own slot mapping where vLLM gives one (the fourth value),
                            # else the metadata's.
                            slots = result[3] if len(result) > 3 and result[3] is not None else meta.slot_mapping
                            common = getattr(meta, COMMON, None)
                            if common is not None:  # a backend of TABLE_KEEPERS: the batch's own tables
                                ring.record_layer(layer, slots, common.block_table_tensor, common.seq_lens,
                                                  common.query_start_loc)
                            else:
                                ring.record_layer(layer, slots, meta.block_table, meta.seq_lens,
                                                  getattr(meta, "query_start_loc", None))
                        except AttributeError as exc:
                            if hasattr(meta, "block_table") and hasattr(meta, "seq_lens"):
                                probe.fail(exc)
                            else:
                                probe.unsupported(meta)
                        except Exception as exc:
                            probe.fail(exc)
                return result
            return wrapper

        def capture_model(orig):
            # FULL CUDA graphs capture attention once, at engine start, before the first execute_model:
            # the ring must exist by then so its launches are captured (they read the step id from
            # device memory, so each replay records under the right step).
            def wrapper(runner, *args, **kwargs):
                if probe.enabled and probe.ring is None:
                    try:
                        probe.ring = probe.make_ring(runner, granularity, layers, sample_every)
                    except Exception as exc:
                        probe.fail(exc)
                return orig(runner, *args, **kwargs)
            return wrapper

        def keep_common(orig, position):
            # build(common_prefix_len, common_attn_metadata, ...): called by keyword by the runners, by
            # position from build_for_cudagraph_capture
            def wrapper(builder, *args, **kwargs):
                meta = orig(builder, *args, **kwargs)
                if probe.enabled:
                    common = kwargs.get("common_attn_metadata")
                    if common is None and len(args) > position:
                        common = args[position]
                    try:  # a metadata class that takes no attribute is read as unsupported, and said
                        setattr(meta, COMMON, common)
                    except Exception:
                        pass
                return meta
            return wrapper

        def attach_builder(module: Any) -> None:
            """Keep the CommonAttentionMetadata on a TABLE_KEEPERS builder's metadata, once its module is
            loaded; a builder that is absent or changed leaves its backend's metadata unreadable (then
            `unsupported`, when a layer reads it)."""
            if not self._patches:
                return
            cls_name = TABLE_KEEPERS[module.__name__]
            try:
                self.check_targets([(module.__name__, f"{cls_name}.build", ("common_attn_metadata",))])
                builder_cls = getattr(module, cls_name)
                params = list(inspect.signature(builder_cls.build).parameters)
                position = params.index("common_attn_metadata") - 1  # without `self`
                self.patch(builder_cls, "build", lambda orig: keep_common(orig, position))
            except Exception as exc:
                self.rec.warn(f"probe {self.name}: {cls_name}.build not patched ({exc}); "
                              "its backend's KV access will be reported unsupported")

        def attach_runner(module: Any) -> None:
            """Patch a model runner once its module is loaded (in a worker); disable on drift."""
            if not self._patches:  # uninstalled meanwhile (at install, `enabled` is not yet set)
                return
            cls_name, req_ids = RUNNERS[module.__name__]
            try:
                self.check_targets([(module.__name__, f"{cls_name}.execute_model", ("scheduler_output",))])
                runner_cls = getattr(module, cls_name)
                self.patch(runner_cls, "execute_model", lambda orig: execute_model(orig, req_ids))
                if "capture_model" in runner_cls.__dict__ or hasattr(runner_cls, "capture_model"):
                    self.patch(runner_cls, "capture_model", capture_model)
            except Exception as exc:
                self.give_up(exc)

        self.patch(attn_mod, "get_attention_context", get_attention_context)
        try:  # MLA imported the function by name: patch its copy too, when the module loads here
            mla = importlib.import_module(MLA)
            if hasattr(mla, "get_attention_context"):
                self.patch(mla, "get_attention_context", get_attention_context)
        except Exception:
            pass
        for module in TABLE_KEEPERS:
            when_imported(module, attach_builder)
        found = [module for module in RUNNERS if when_imported(module, attach_runner)]
        if not found:
            raise TargetMissing(f"no model runner module ({', '.join(RUNNERS)})")

    def start_pass(self, runner: Any, step: int | None, granularity: str, layers: Any, sample_every: int) -> bool:
        """A forward pass before the first tagged step, or one without a step id: make the ring on the first
        pass, name the process for its worker, and start the ring's step. False: a pass without our step id
        (a warm-up or dummy run on fake requests), to run unrecorded: its rows would take the ids of real
        steps."""
        if self.step < 0:  # until the first tagged step: a process that also schedules (tensor parallel 1)
            self.rec.role = "worker"  # is named for its worker
        if self.ring is None:
            self.set_rank(runner)
            self.ring = self.make_ring(runner, granularity, layers, sample_every)
        if step is None:
            self.untagged += 1
            if self.untagged == UNTAGGED_BEFORE_SAYING and self.step < 0:
                self.say_untagged()  # in proc.json at the next flush, should the worker be killed
            self.ring.begin_step(self.step, record=False)
            return False
        if self.step < 0 and self.untagged >= UNTAGGED_BEFORE_SAYING:
            self.rec.set_probe_status(self.name, "attached")  # the step ids came after all
        self.step = step
        self.ring.begin_step(step)
        return True

    def unsupported(self, meta: Any) -> None:
        """The backend's metadata has no block table and sequence lengths to read: say so, and stop
        trying (the engine is unaffected)."""
        what = type(meta).__name__
        self.enabled = False
        self.rec.set_probe_status(self.name, "unsupported", f"unsupported: {what} has no block_table/seq_lens")
        self.rec.warn(f"probe {self.name}: attention metadata {what} is not supported; no KV access recorded")

    def nvtx_layer(self, layer: int | None) -> None:
        """Per-layer ranges (--nvtx-layers): `kvtrace layer N` runs from layer N's attention read to the
        next layer's, so it covers the attention and what follows it; the last closes with the pass."""
        if not self.nvtx_layers:
            return
        try:
            if self.open_layer_range:
                _nvtx.pop()
                self.open_layer_range = False
            if layer is not None and _nvtx.layer(layer) is not _nvtx._NOTHING:
                self.open_layer_range = True
        except Exception as exc:
            self.fail(exc)

    def nvtx_execute(self):
        """`kvtrace execute` around the forward pass (a no-op context when NVTX is off)."""
        try:
            return _nvtx.phase("execute") if _nvtx is not None else _NULL
        except Exception:
            return _NULL

    def install(self) -> bool:
        if self.options.get("kv_granularity") == "off":
            self.rec.set_probe_status(self.name, "off", "--kv-granularity off")
            return False
        return super().install()  # installs when the attention module is imported (defer_until)

    def set_rank(self, runner: Any) -> None:
        """Rows carry rank = dp_rank * 1000 + tp_rank of this worker."""
        dp = int(getattr(runner.parallel_config, "data_parallel_rank", 0) or 0)
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp = int(get_tensor_model_parallel_rank())
        except Exception:  # not initialised (single process): rank 0
            tp = 0
        self.rec.rank = dp * 1000 + tp

    def make_ring(self, runner: Any, granularity: str, layers: Any, sample_every: int):
        from kvtrace.probes.kv_access import make_ring

        block_size = runner.cache_config.block_size
        capacity = int(self.options.get("kv_ring_capacity", 1 << 20))
        ring = make_ring(runner.device, capacity=capacity, block_size=block_size,
                         granularity=granularity, layers=layers, sample_every=sample_every,
                         recorder=self.rec,
                         # CUDA only: record kernels inline in captured graphs, cheaper in a real
                         # engine than forked beside attention ({"kv_overlap": true}; docs/device-ring.md)
                         overlap=bool(self.options.get("kv_overlap", False)),
                         # --kv-layers all: the layers of a KV-cache group recorded once, copied at
                         # ingest; {"kv_share_layers": false} records every layer's own
                         share_layers=bool(self.options.get("kv_share_layers", True)))
        if "kv_drain_interval_s" in self.options and hasattr(ring, "DRAIN_EVERY_S"):
            # CUDA ring, experts and benchmarks: the background thread's longest wait between drains
            # (it drains sooner when the ring may fill; once a millisecond at most)
            ring.DRAIN_EVERY_S = float(self.options["kv_drain_interval_s"])
        if "kv_native_drain" in self.options and hasattr(ring, "native_drain"):
            # CUDA ring, benchmarks: {"kv_native_drain": false} drains through torch and NumPy instead of
            # _drain.c (its GIL hand-overs are what the native drain saves)
            ring.native_drain = bool(self.options["kv_native_drain"])
        if "kv_drain_loop" in self.options and hasattr(ring, "drain_loop"):
            # CUDA ring, benchmarks: {"kv_drain_loop": false} comes back to Python for every drain (one native
            # call a drain, the records handed over in Python) instead of draining in a loop in C that never
            # takes the GIL
            ring.drain_loop = bool(self.options["kv_drain_loop"])
        if "kv_native_launch" in self.options and hasattr(ring, "native_launch"):
            # CUDA ring, benchmarks: {"kv_native_launch": false} launches through CuPy, which lets the GIL
            # go around each launch, instead of _drain.c's launch, which keeps it
            ring.native_launch = bool(self.options["kv_native_launch"])
        if "kv_defer_state" in self.options and hasattr(ring, "defer_state"):
            # CUDA ring, benchmarks: {"kv_defer_state": false} makes the per-step state launch in
            # begin_step, the step's first CUDA call, instead of just before the ring's first kernel
            ring.defer_state = bool(self.options["kv_defer_state"])
        return ring

    def take(self) -> None:
        """Hand the batch slot runs held so far to the recorder (also when the engine goes idle, and at
        close)."""
        slots = getattr(self, "slots", None)
        cols = slots.take() if slots is not None else None
        if cols is not None:
            self.rec.append_columns("batch_slot_runs", cols)

    def close(self) -> None:
        self.take()
        if self.ring is not None:
            self.ring.close()
        if getattr(self, "untagged", 0) and self.step < 0 and self.enabled:
            self.say_untagged()

    def say_untagged(self) -> None:
        """Forward passes ran, none with a step id: the scheduler probe did not tag them (off, or not
        attached in the engine), so nothing could be recorded under a step. Said, not hidden."""
        self.rec.set_probe_status(self.name, "degraded", f"not recorded: {self.untagged} forward passes had "
                                  "no step id from the scheduler probe (is it on and attached?)")
