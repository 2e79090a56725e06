"""An offload tier's BlockPool is recorded apart from the engine's own: vLLM's SimpleCPUOffloadConnector
(scheduler side, vLLM's code) keeps CPU blocks in a second `BlockPool` whose ids start at 0 like the
GPU's. Its calls must go to `offload_block_events` with the pool's name, never into `block_events`.

Driven without a model (tests/helpers/driven_scheduler.py): the connector's worker side is
`instant_offload_output`, which reports every store and load of a step as finished within it. After
every engine step, the blocks each pool holds (vLLM's own `ref_cnt`s) must equal what replaying that
pool's recorded rows up to the step gives, so a row in the wrong table, or a missing one, shows.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from kvtrace.record.context import ctx
from tests.helpers.driven_scheduler import DrivenConfig, read_rows, record_driven, shared_prefix_prompts
from tests.helpers.run import query, run_kvtrace

try:  # vLLM 0.32 and later
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler  # noqa: F401
except Exception as exc:  # pragma: no cover
    pytest.skip(f"this vLLM has no SimpleCPUOffloadConnector: {exc}", allow_module_level=True)

GPU_BLOCKS = 40  # small enough that the second wave's prefixes were evicted from the GPU
CPU_POOL = "SimpleCPUOffloadConnector.scheduler_manager.cpu_block_pool"


def in_use(pool) -> set[int]:
    return {b.block_id for b in pool.blocks if b.ref_cnt > 0 and b is not pool.null_block}


def scenario(d):
    """Three waves: prompt families whose blocks are stored to the CPU tier, other prompts that evict
    them from the GPU pool, then the first families again, which find their prefixes in the CPU tier."""
    gpu = d.sched.kv_cache_manager.block_pool
    cpu = d.sched.connector.scheduler_manager.cpu_block_pool
    held: dict[int, tuple[set[int], set[int]]] = {}
    first, other = shared_prefix_prompts(12, 3, 256, 40, seed=1), shared_prefix_prompts(12, 3, 256, 40, seed=2)
    for wave, prompts in enumerate((first, other, first)):
        for i, p in enumerate(prompts):
            d.add(f"w{wave}-r{i}", p, 16)
        while d.has_work() and d.steps < 2000:
            d.step()
            held[ctx.step] = (in_use(gpu), in_use(cpu))  # the step id the probes gave this step's rows
    return {"held": held, "transfers": dict(d.transfers), "cpu_blocks": cpu.num_gpu_blocks}


@pytest.fixture(scope="module")
def offload_run(tiny_model, tmp_path_factory):
    session = tmp_path_factory.mktemp("offload") / "s"
    cfg = DrivenConfig(num_blocks=GPU_BLOCKS, max_num_seqs=4, cpu_offload_bytes=32 << 20)
    result = record_driven(session, tiny_model, cfg, scenario)
    return session, result


def replay(rows: list[dict]) -> dict[int, set[int]]:
    """The blocks with references after each step, from a pool's rows in recording order."""
    ref: Counter = Counter()
    after: dict[int, set[int]] = {}
    by_step = defaultdict(list)
    for r in rows:
        by_step[r["step"]].append(r)
    for step in sorted(by_step):
        for r in by_step[step]:
            for b in r["block_ids"]:
                if r["event"] == "alloc":
                    assert ref[b] == 0, f"block {b} allocated while held (step {step})"
                    ref[b] = 1
                elif r["event"] in ("touch", "hold"):
                    ref[b] += 1
                elif r["event"] in ("free", "release"):
                    ref[b] -= 1
                    assert ref[b] >= 0, f"block {b} freed more often than held (step {step})"
        after[step] = {b for b, n in ref.items() if n > 0}
    return after


def test_each_pool_replays_to_vllms_own_references(offload_run):
    session, result = offload_run
    gpu_rows, cpu_rows = read_rows(session, "block_events"), read_rows(session, "offload_block_events")
    assert result["transfers"]["stored_blocks"] > 0 and result["transfers"]["loaded_blocks"] > 0, result["transfers"]
    assert {r["pool"] for r in cpu_rows} == {CPU_POOL}
    gpu_after, cpu_after = replay(gpu_rows), replay(cpu_rows)
    gpu_now: set[int] = set()
    cpu_now: set[int] = set()
    checked = 0
    for step in sorted(result["held"]):
        gpu_now = gpu_after.get(step, gpu_now)
        cpu_now = cpu_after.get(step, cpu_now)
        gpu_vllm, cpu_vllm = result["held"][step]
        assert gpu_now == gpu_vllm, f"GPU pool after step {step}"
        assert cpu_now == cpu_vllm, f"CPU pool after step {step}"
        checked += 1
    assert checked > 20
    # No CPU-tier block id in the GPU table: the GPU pool has GPU_BLOCKS blocks, the CPU tier many more.
    assert max(b for r in gpu_rows for b in r["block_ids"]) < GPU_BLOCKS
    assert max(b for r in cpu_rows for b in r["block_ids"]) >= GPU_BLOCKS


def test_the_connectors_own_references_are_holds(offload_run):
    """SimpleCPUOffloadConnector keeps the GPU blocks it stores referenced until the store is done
    (`touch`, then `free_blocks`, from its own methods): recorded as hold and release, not as prefix-cache
    hits and request frees. Every hold was released by the end (every transfer finished)."""
    session, _ = offload_run
    gpu_rows = read_rows(session, "block_events")
    held = Counter(b for r in gpu_rows if r["event"] == "hold" for b in r["block_ids"])
    released = Counter(b for r in gpu_rows if r["event"] == "release" for b in r["block_ids"])
    assert held and held == released
    # The scheduler's own touches are prefix-cache hits: each names the request that hit.
    assert all(r["request_id"] for r in gpu_rows if r["event"] == "touch")


def test_stores_allocate_cpu_blocks_one_for_one(offload_run):
    """Every block the connector stored went into a CPU block it allocated for it (eager mode)."""
    session, result = offload_run
    allocated = sum(len(r["block_ids"]) for r in read_rows(session, "offload_block_events") if r["event"] == "alloc")
    assert allocated == result["transfers"]["stored_blocks"]


def test_ingest_keeps_the_pools_apart(offload_run, tmp_path):
    session, _ = offload_run
    db = tmp_path / "o.duckdb"
    run_kvtrace("ingest", str(session), "-o", str(db))
    (pools,) = query(db, "select list(distinct pool) from offload_block_events")
    assert pools == ([CPU_POOL],)
    (gpu_max, cpu_rows), = query(db, "select (select max(block_id) from block_events), "
                                     "(select count(*) from offload_block_events)")
    assert gpu_max < GPU_BLOCKS and cpu_rows > 0


def test_each_other_pool_keeps_one_log_when_calls_alternate(tmp_path):
    """The main log remembers only the last pool it routed; calls alternating between two other pools
    (an offload tier's and a connector's lookup pool) still give each pool one log, one name."""
    from kvtrace.probes.vllm.kv_blocks import BlockPoolProbe
    from kvtrace.record.recorder import Recorder

    class Pool:  # any object the log can hold weakly
        pass

    rec = Recorder(tmp_path / "s", "engine", {})
    probe = BlockPoolProbe(rec, rec.options)
    assert probe.install()
    try:
        gpu, cpu, lookup = Pool(), Pool(), Pool()
        probe.log.main_pool = gpu
        logs = [probe.log.for_pool(p) for p in (cpu, lookup, cpu, lookup, gpu)]
        assert logs[0] is logs[2] and logs[1] is logs[3] and logs[0] is not logs[1] and logs[4] is probe.log
        assert [name for name, _ in probe.pool_logs] == ["unnamed-1", "unnamed-2"]
    finally:
        probe.uninstall()
        rec.close()
