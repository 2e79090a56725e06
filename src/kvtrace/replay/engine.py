"""vLLM's own Scheduler and KV cache manager, run without a model on the CPU, with every request's
output tokens scripted (a replay knows each sequence in advance: workload.sequence).

The VllmConfig comes from `EngineArgs(...).create_engine_config()` as a real engine's does, for kvtrace's
tiny offline Llama (`kvtrace make-model`; the scheduler needs a model config, not weights) with the
recording's scheduling settings; the KVCacheConfig is one full-attention group of `num_blocks` blocks
(block 0 is vLLM's null block), as a worker would report it. Each step: schedule(), a made-up
ModelRunnerOutput (one token for each request that finished its prompt), update_from_output().
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.replay.offload import instant_offload_output, offload_transfer_config

VOCAB = 512  # the tiny model's vocabulary


@dataclass
class SchedulerSettings:
    """What the replayed scheduler is built with (engine-argument names)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    # "module.Class" of a vLLM Scheduler subclass (a policy), importable here; None: vLLM's own. Never
    # taken from the recording: the command line names the code it runs.
    scheduler_cls: str | None = None
    # Bytes of a CPU offload tier (vLLM's SimpleCPUOffloadConnector, offload.py); None: none.
    cpu_offload_bytes: int | None = None


def load_scheduler_cls(path: str) -> type:
    """The class `path` ("module.Class") names, which must subclass vLLM's Scheduler."""
    import importlib

    from vllm.v1.core.sched.scheduler import Scheduler

    module, _, name = path.rpartition(".")
    if not module or not name.isidentifier():
        raise KvtraceError(f"--scheduler-cls {path!r}: give module.Class (importable here, e.g. with PYTHONPATH)")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception as exc:  # ImportError, AttributeError, or the module's own failure
        raise KvtraceError(f"--scheduler-cls {path}: cannot import it ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:200]})") from None
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise KvtraceError(f"--scheduler-cls {path}: not a subclass of vLLM's Scheduler")
    return cls


def build_scheduler(config: Any, block_size: int, num_blocks: int, with_tensors: bool = False,
                    log_stats: bool = True, scheduler_cls: type | None = None) -> tuple[Any, Any]:
    """(vLLM's Scheduler for `config`, the block hasher its requests need), with a KVCacheConfig of one
    full-attention group shaped like the config's model, as a worker would report it. `with_tensors`:
    describe the worker's allocation too (connectors that size their own pools from it need it).
    `scheduler_cls`: a Scheduler subclass to build instead."""
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks  # what EngineCore sets once workers report
    hf = config.model_config.hf_config
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=hf.num_key_value_heads,
                             head_size=hf.hidden_size // hf.num_attention_heads, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    tensors = []
    if with_tensors:  # one layer-outermost allocation
        page = spec.page_size_bytes
        tensors = [KVCacheTensor(size=page * num_blocks * len(layers), layers=layers,
                                 layer_stride=page * num_blocks, block_stride=page, offset=0)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                                    kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    kv_cache_config.hash_block_size = block_size
    sched = (scheduler_cls or Scheduler)(vllm_config=config, kv_cache_config=kv_cache_config,
                      structured_output_manager=StructuredOutputManager(config),
                      block_size=block_size, hash_block_size=block_size, log_stats=log_stats)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    # vLLM 0.33's lookahead block hashes (EAGLE-style drafting with prefix caching): a block's hash also
    # covers the tokens after it, and the requests must be hashed as the scheduler's pool expects.
    lookahead = getattr(sched, "num_hash_lookahead_tokens", 0) or 0
    return sched, (get_request_block_hasher(block_size, hash_fn, lookahead) if lookahead
                   else get_request_block_hasher(block_size, hash_fn))


class ReplayEngine:
    def __init__(self, model_dir: str, s: SchedulerSettings):
        from vllm.engine.arg_utils import EngineArgs

        # The tiny model's config says 4,096 positions; the recorded model's max_model_len may be longer.
        # No model runs here, so vLLM's check of positions against the weights does not apply.
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        extra = {"kv_transfer_config": offload_transfer_config(s.cpu_offload_bytes)} if s.cpu_offload_bytes else {}
        args = EngineArgs(model=model_dir, dtype="float32", max_model_len=s.max_model_len, block_size=s.block_size,
                          max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                          enable_prefix_caching=s.enable_prefix_caching, enforce_eager=True,
                          num_gpu_blocks_override=s.num_blocks, seed=0, **extra)
        try:
            config = args.create_engine_config()
        except Exception as exc:  # vLLM's own checks of the settings (pydantic, ValueError)
            why = " ".join(str(exc).split())
            why = why.split("Value error, ")[-1][:240]
            raise KvtraceError(f"vLLM refuses these scheduler settings ({vars(s)}): {why}") from None
        cls = load_scheduler_cls(s.scheduler_cls) if s.scheduler_cls else None
        # (the offload connector sizes its CPU pool from the worker's KV tensors: describe them)
        self.sched, self.block_hasher = build_scheduler(config, s.block_size, s.num_blocks, scheduler_cls=cls,
                                                        with_tensors=bool(s.cpu_offload_bytes))
        self.transfers = {"stored_blocks": 0, "loaded_blocks": 0}  # blocks the offload tier moved
        self.sequences: dict[str, list[int]] = {}  # request -> prompt + output tokens
        self.prompt_len: dict[str, int] = {}
        self.steps = 0

    def add(self, request_id: str, tokens: list[int], prompt_len: int, max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max(max_tokens, 1), ignore_eos=True, temperature=0.0)
        self.sequences[request_id], self.prompt_len[request_id] = tokens, prompt_len
        self.sched.add_request(Request(request_id=request_id, prompt_token_ids=tokens[:prompt_len],
                                       sampling_params=params, pooling_params=None,
                                       block_hasher=self.block_hasher))

    def step(self, forward: Any = None) -> Any:
        """One engine step; returns the SchedulerOutput. `forward(scheduler_output)` runs where the model
        would, between schedule() and update_from_output() (--clock timed waits there)."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.sched
        out = sched.schedule()
        if forward is not None:
            forward(out)
        requests = sched.requests
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = requests[rid]
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            seq, n = self.sequences[rid], self.prompt_len[rid] + req.num_output_tokens
            sampled.append([seq[n] if n < len(seq) else 0])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=instant_offload_output(out.kv_connector_metadata, self.transfers))
        sched.update_from_output(out, mro)
        self.steps += 1
        return out

    def has_work(self) -> bool:
        return self.sched.has_requests()
