"""vLLM's CUDA build recorded end to end on a GPU: every CUDA graph mode, the attention backends, both
model runners. Each case records the demo workload (shared prefixes, a KV pool small enough to preempt)
under `kvtrace record --kv-granularity blocks --kv-layers all`, ingests it, and checks:

- `summary` equals vLLM's own counters (requests, prefix-cache query and hit tokens, preemptions), the
  session is `complete` and nothing was dropped;
- every engine step has a row;
- for every step, request and layer, the KV blocks read are exactly those of the request's block table
  as the scheduler's own block events give it, and the tokens written are the ones scheduled.

Skipped without CUDA or without vLLM's CUDA build. On the GPU machine: `bash scripts/gpu/run_suite.sh`
(docs/gpu.md). Sessions and a results table go to $KVTRACE_GPU_OUT when set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import torch
except Exception as exc:  # pragma: no cover
    pytest.skip(f"torch is not importable: {exc}", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    import vllm  # noqa: F401
    from vllm.platforms import current_platform
except Exception as exc:  # pragma: no cover
    pytest.skip(f"vLLM is not importable: {exc}", allow_module_level=True)
if not current_platform.is_cuda():
    pytest.skip("vLLM here is not its CUDA build", allow_module_level=True)

import duckdb  # noqa: E402

from tests.helpers.kv_checks import check_reads_and_writes, expected_records  # noqa: E402
from tests.helpers.run import vllm_reported_prefix_tokens  # noqa: E402

BLOCK = 32
LAYERS = 4
OUT = Path(os.environ["KVTRACE_GPU_OUT"]) if os.environ.get("KVTRACE_GPU_OUT") else None

# (case id, engine arguments beyond the workload's, environment). vLLM's default on CUDA is Model
# Runner V2 with CUDA graphs FULL_AND_PIECEWISE; `VLLM_USE_V2_MODEL_RUNNER=0` forces the V1 runner.
# vLLM 0.26's offline engine drops the scheduler stats of a step that returned no request output
# (`LLMEngine.step` records stats only `if ... len(outputs.outputs) > 0`): the prefix-cache lookups made in
# such a step (a first prefill chunk, which produces no token) are counted by vLLM's scheduler but never
# reach its Prometheus counters. `vllm_reported_prefix_tokens` (tests/helpers/run.py) models that, for sync
# scheduling, where a step's lookups are in that step's stats (vLLM 0.32 records every step's stats). With async scheduling (vLLM's default on CUDA) stats travel a step later and
# more of them are dropped, by a different amount in each run (2026-11-26, H100), while kvtrace's counts
# are the same from run to run: the exactness cases run with it off, and `v2-default-async` records vLLM's
# defaults and checks the rest.
CASES = [
    ("v2-eager-flash", {"enforce_eager": True, "attention_config": {"backend": "FLASH_ATTN"}}, {}),
    ("v2-piecewise-flash", {"compilation_config": {"cudagraph_mode": "PIECEWISE"},
                            "attention_config": {"backend": "FLASH_ATTN"}}, {}),
    ("v2-full-flash", {"compilation_config": {"cudagraph_mode": "FULL"},
                       "attention_config": {"backend": "FLASH_ATTN"}}, {}),
    ("v2-default-flash", {"attention_config": {"backend": "FLASH_ATTN"}}, {}),
    ("v2-default-triton", {"attention_config": {"backend": "TRITON_ATTN"}}, {}),
    ("v2-eager-triton", {"enforce_eager": True, "attention_config": {"backend": "TRITON_ATTN"}}, {}),
    ("v2-piecewise-triton", {"compilation_config": {"cudagraph_mode": "PIECEWISE"},
                             "attention_config": {"backend": "TRITON_ATTN"}}, {}),
    ("v2-full-triton", {"compilation_config": {"cudagraph_mode": "FULL"},
                        "attention_config": {"backend": "TRITON_ATTN"}}, {}),
    ("v2-default-flex", {"attention_config": {"backend": "FLEX_ATTENTION"}}, {}),
    # FlashInfer plans the batch into its kernels' wrappers: read through its builder, as MLA is
    ("v2-default-flashinfer", {"attention_config": {"backend": "FLASHINFER"}}, {}),
    ("v1-default-flash", {"attention_config": {"backend": "FLASH_ATTN"}}, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    ("v1-eager-flash", {"enforce_eager": True, "attention_config": {"backend": "FLASH_ATTN"}},
     {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    ("v2-default-async", {"async_scheduling": True}, {}),
]
# Every case records --kv-layers all with the ring's default options (the layers of a KV-cache group
# shared: recorded once, copied at ingest; record kernels inline in the CUDA graphs). These cases run once
# more with each option here that is not the default: every layer's own records from its own metadata;
# record kernels forked beside attention on a side stream.
OPTION_RUNS = {
    "every-layer": ({"kv_share_layers": False}, ("v2-default-flash", "v2-eager-triton")),
    "overlap": ({"kv_overlap": True}, ("v2-default-flash", "v2-full-triton")),
    # each drain one native call from the ring's Python thread, not the drain loop in C (the default)
    "drain-calls": ({"kv_drain_loop": False}, ("v2-default-flash",)),
}
RUNS = [(name, engine_args, env, {}) for name, engine_args, env in CASES] + [
    (f"{name}-{suffix}", engine_args, env, options) for suffix, (options, names) in OPTION_RUNS.items()
    for name, engine_args, env in CASES if name in names]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from kvtrace.demo.model import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny4", layers=LAYERS))


def record(tmp: Path, name: str, model: str, engine_args: dict, env: dict, record_args: list[str],
           workload_args: list[str] = ()) -> dict:
    session, metrics, db = tmp / name, tmp / f"{name}-metrics.json", tmp / f"{name}.duckdb"
    full_env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", **env}
    args = {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.3, "async_scheduling": False,
            **engine_args}
    cmd = [sys.executable, "-m", "kvtrace", "record", "-o", str(session), *record_args, "--",
           sys.executable, "-m", "kvtrace.demo.workload", "--model", model, "--metrics-out", str(metrics),
           "--engine-args", json.dumps(args), *workload_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=400)
    log = proc.stdout[-4000:] + proc.stderr[-12000:]
    if OUT is not None:
        (OUT / "logs").mkdir(parents=True, exist_ok=True)
        (OUT / "logs" / f"{name}.log").write_text(log)
    assert proc.returncode == 0, log
    ingest = subprocess.run([sys.executable, "-m", "kvtrace", "ingest", str(session), "-o", str(db)],
                            capture_output=True, text=True, env=full_env, timeout=300)
    assert ingest.returncode == 0, ingest.stderr[-4000:]
    if OUT is not None:  # kept before any check, so a failing case can be read back
        shutil.copy(db, OUT / "logs" / f"{name}.duckdb")
    return {"session": session, "db": db, "metrics": json.loads(metrics.read_text()), "log": log}


def summary(db: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvtrace", "query", str(db), "summary", "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    return row


def note(name: str, row: dict) -> None:
    if OUT is not None:
        with open(OUT / "results.jsonl", "a") as f:
            f.write(json.dumps({"case": name, **row}, default=str) + "\n")


@pytest.mark.parametrize("name, engine_args, env, options", RUNS, ids=[r[0] for r in RUNS])
def test_recorded_run_is_exact(name, engine_args, env, options, model, tmp_path):
    if "flashinfer" in name and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("the flashinfer package is not installed (scripts/gpu/pack_vllm.sh leaves it out)")
    run = record(tmp_path, name, model, engine_args, env, ["--kv-granularity", "blocks", "--kv-layers", "all",
                                                            "--options-json", json.dumps(options)])
    check_exact(name, run, engine_args, BLOCK)


# Multi-head Latent Attention (DeepSeek-V2/V3): its metadata splits the batch into decode and prefill
# parts with no whole-batch block table; the probe reads the builder's CommonAttentionMetadata instead.
# On Hopper vLLM picks FLASH_ATTN_MLA; FlashMLA takes 64-token blocks only.
MLA_CASES = [
    ("mla-default", {}, 32),
    ("mla-eager-triton", {"enforce_eager": True, "attention_config": {"backend": "TRITON_MLA"}}, 32),
    ("mla-default-triton", {"attention_config": {"backend": "TRITON_MLA"}}, 32),
    ("mla-default-flashmla", {"attention_config": {"backend": "FLASHMLA"}}, 64),
]


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> str:
    from kvtrace.demo.model import ensure_tiny_mla_model

    return str(ensure_tiny_mla_model(tmp_path_factory.mktemp("model") / "tiny-mla", layers=LAYERS))


@pytest.mark.parametrize("name, engine_args, block", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_recorded_run_is_exact(name, engine_args, block, mla_model, tmp_path):
    args = {"load_format": "dummy", "block_size": block, **engine_args}
    # the pool is sized in blocks: 64-token blocks get half as many, the same tokens
    extra = ["--num-blocks", str(40 * BLOCK // block)]
    run = record(tmp_path, name, mla_model, args, {}, ["--kv-granularity", "blocks", "--kv-layers", "all"],
                 workload_args=extra)
    check_exact(name, run, args, block)


def check_exact(name: str, run: dict, engine_args: dict, block: int) -> None:
    """The recorded run against vLLM's own counters and the scheduler's own block tables."""
    vllm_counts = run["metrics"]["vllm"]
    row = summary(run["db"])
    con = duckdb.connect(str(run["db"]), read_only=True)
    try:
        probes = con.execute("select probe, role, status, reason from probes order by 1, 2").fetchall()
        (n, lo, hi, distinct), = con.execute("select count(*), min(step), max(step), count(distinct step) "
                                             "from steps").fetchall()
        layers = [r[0] for r in con.execute("select distinct layer from kv_access order by 1").fetchall()]
        (timing_steps,), = con.execute("select count(distinct step) from layer_timings").fetchall()
        checked = check_reads_and_writes(con, block, layers) if layers else 0
        (records,), = con.execute("select count(*) from kv_access").fetchall()
        expected = expected_records(con, block, LAYERS)
        lookups = con.execute("select step, request_id, query_tokens, hit_tokens, after_preemption from "
                              "prefix_lookups order by ts_ns").fetchall()
        reported = vllm_reported_prefix_tokens(con)
    finally:
        con.close()
    note(name, {**row, "vllm": vllm_counts, "probes": probes, "layers": layers, "checked": checked,
                "records": records, "expected_records": expected, "lookups": lookups, "vllm_reported": reported})
    assert row["status"] == "complete", (row, probes)
    assert row["requests"] == 18 and row["dropped_events"] == 0, row
    if engine_args.get("async_scheduling"):  # vLLM's counters may miss lookups here (see CASES)
        assert row["prefix_query_tokens"] >= vllm_counts["prefix_cache_queries"] > 0
        assert row["prefix_hit_tokens"] >= vllm_counts["prefix_cache_hits"] > 0
    else:  # every lookup vLLM counted and reported, and only those (see vllm_reported_prefix_tokens)
        assert reported == (vllm_counts["prefix_cache_queries"], vllm_counts["prefix_cache_hits"])
        assert row["prefix_query_tokens"] >= reported[0] and row["prefix_hit_tokens"] >= reported[1]
    assert row["preemptions"] == vllm_counts["num_preemptions"] and vllm_counts["num_preemptions"] > 0
    assert (lo, hi, distinct) == (1, n, n), "every engine step has a row"
    assert layers == list(range(LAYERS)), (layers, probes)
    assert timing_steps > 0 and checked > 100
    assert records == expected, "a record for every block of every layer of every step"


@pytest.mark.parametrize("share", [True, False], ids=["shared-layers", "every-layer"])
def test_a_small_ring_counts_exact_drops(share, model, tmp_path):
    """With a ring far too small for every layer's block records, the records lost are counted, not
    hidden: rows kept plus rows counted as dropped equal the records the run must produce (from the
    scheduler's own block tables), and the session does not say `complete`. With layers shared (the
    default: the 4 layers of the one KV-cache group recorded once, copied at ingest) a lost record counts
    for its 4 rows."""
    name = f"v2-default-flash-small-ring-{'shared' if share else 'every-layer'}"
    run = record(tmp_path, name, model, {"attention_config": {"backend": "FLASH_ATTN"}}, {},
                 ["--kv-granularity", "blocks", "--kv-layers", "all", "--kv-ring-capacity", "64" if share else "256",
                  "--options-json", json.dumps({"kv_share_layers": share})])
    con = duckdb.connect(str(run["db"]), read_only=True)
    try:
        (rows,), = con.execute("select count(*) from kv_access").fetchall()
        (dropped,), = con.execute("select coalesce(sum(dropped), 0) from drops where table_name = 'kv_access'"
                                  ).fetchall()
        expected = expected_records(con, BLOCK, LAYERS)
    finally:
        con.close()
    row = summary(run["db"])
    note(name, {"rows": rows, "dropped": dropped, "expected": expected, "status": row["status"]})
    assert dropped > 0 and rows + dropped == expected, (rows, dropped, expected)
    assert row["status"] != "complete" and row["dropped_events"] >= dropped


def test_cpu_offload_keeps_its_pool_apart(model, tmp_path):
    """vLLM's SimpleCPUOffloadConnector on the GPU (its worker copies with CUDA): the CPU tier's BlockPool
    numbers its blocks from 0 like the GPU's, so its calls must land in offload_block_events under the
    pool's name, never in block_events; the GPU blocks it held while storing are released by the end;
    the blocks its worker copied to the CPU equal the blocks its CPU pool handed out, and the tokens it
    loaded back equal vLLM's external prefix-cache hits; vLLM's own counters still match. The same workload recorded without the connector is then put beside it with
    `kvtrace compare` (table and figures kept in $KVTRACE_GPU_OUT)."""
    name = "v2-default-cpu-offload"
    args = {"kv_transfer_config": {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"cpu_bytes_to_use": 256 << 20}}}
    run = record(tmp_path, name, model, args, {}, ["--kv-granularity", "off"])
    con = duckdb.connect(str(run["db"]), read_only=True)
    try:
        pools = con.execute("select pool, count(*), max(block_id) from offload_block_events group by 1").fetchall()
        (cpu_allocated,), = con.execute("select count(*) from offload_block_events where event = 'alloc'").fetchall()
        (gpu_blocks,), = con.execute("select num_kv_blocks from sessions").fetchall()
        (gpu_max,), = con.execute("select max(block_id) from block_events").fetchall()
        holds = dict(con.execute("select event, count(*) from block_events where event in ('hold', 'release') "
                                 "group by 1").fetchall())
        transfers = con.execute("select connector, method, direction, count(*), sum(tokens), sum(bytes) "
                                "from transfers group by all order by all").fetchall()
        (stored_tokens, loaded_tokens), = con.execute(
            "select coalesce(sum(tokens) filter (direction = 'save'), 0), coalesce(sum(tokens) filter "
            "(direction = 'load'), 0) from transfers where method = 'get_finished' and tokens is not null").fetchall()
    finally:
        con.close()
    row = summary(run["db"])
    note(name, {**row, "pools": pools, "gpu_blocks": gpu_blocks, "gpu_max": gpu_max, "holds": holds,
                "transfers": transfers, "cpu_allocated": cpu_allocated, "stored_tokens": stored_tokens,
                "loaded_tokens": loaded_tokens,
                "vllm": run["metrics"]["vllm"]})
    plain = record(tmp_path, "v2-default-plain", model, {}, {}, ["--kv-granularity", "off"])
    out = (OUT or tmp_path) / "offload-compare"
    cmp = subprocess.run([sys.executable, "-m", "kvtrace", "compare", str(plain["db"]), str(run["db"]), "-o",
                          str(out), "--format", "csv"], capture_output=True, text=True, timeout=300)
    if OUT is not None:
        (OUT / "offload-compare.csv").write_text(cmp.stdout + cmp.stderr)
        shutil.make_archive(str(OUT / "offload-compare"), "gztar", root_dir=str(out))
        shutil.rmtree(out)
    assert row["status"] == "complete" and row["requests"] == 18, row
    assert [p[0] for p in pools] == ["SimpleCPUOffloadConnector.scheduler_manager.cpu_block_pool"], pools
    assert gpu_max <= gpu_blocks, (gpu_max, gpu_blocks)  # num_kv_blocks: usable blocks (the null block is 0)
    assert holds.get("hold", 0) > 0, holds
    assert cpu_allocated > 0 and stored_tokens == cpu_allocated * BLOCK, (stored_tokens, cpu_allocated, transfers)
    # what it loaded back is what vLLM counted as external prefix-cache hits
    assert loaded_tokens == run["metrics"]["vllm"]["external_prefix_cache_hits"] > 0, (loaded_tokens, transfers)
    assert row["preemptions"] == run["metrics"]["vllm"]["num_preemptions"]
    assert cmp.returncode == 0, cmp.stderr[-3000:]


def test_tensor_parallel_ranks_join_the_same_steps(model, tmp_path):
    """`--tensor-parallel-size 2`: each worker records its own KV access rows under its rank, each rank's
    records are exactly its block tables' (every layer of every step), and both ranks' rows join to the
    same engine steps; the engine's counters still equal vLLM's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    name = "v2-default-tp2"
    run = record(tmp_path, name, model, {"tensor_parallel_size": 2, "attention_config": {"backend": "FLASH_ATTN"}},
                 {}, ["--kv-granularity", "blocks", "--kv-layers", "all"])
    row = summary(run["db"])
    con = duckdb.connect(str(run["db"]), read_only=True)
    try:
        procs = con.execute("select role, rank, status from procs order by 1, 2").fetchall()
        per_rank = dict(con.execute("select rank, count(*) from kv_access group by 1").fetchall())
        timing_ranks = [r[0] for r in con.execute("select distinct rank from layer_timings order by 1").fetchall()]
        (orphans,), = con.execute("select count(*) from kv_access a anti join steps s on a.step = s.step").fetchall()
        step_sets = con.execute("select rank, count(distinct step) from kv_access group by 1 order by 1").fetchall()
        (both,), = con.execute("select count(*) from (select step from kv_access group by step "
                               "having count(distinct rank) = 2)").fetchall()
        expected = expected_records(con, BLOCK, LAYERS)
        checked = {r: check_reads_and_writes(con, BLOCK, list(range(LAYERS)), rank=r) for r in per_rank}
    finally:
        con.close()
    note(name, {**row, "procs": procs, "per_rank": per_rank, "expected_per_rank": expected,
                "step_sets": step_sets, "steps_with_both": both, "checked": checked, "vllm": run["metrics"]["vllm"]})
    assert row["status"] == "complete" and row["requests"] == 18 and row["dropped_events"] == 0, row
    assert row["preemptions"] == run["metrics"]["vllm"]["num_preemptions"]
    assert sorted(per_rank) == [0, 1] and timing_ranks == [0, 1], (per_rank, timing_ranks)
    assert per_rank[0] == per_rank[1] == expected, (per_rank, expected)
    assert orphans == 0 and step_sets[0][1] == step_sets[1][1] == both > 0, (orphans, step_sets, both)
    assert all(n > 100 for n in checked.values()), checked


def teardown_module(module) -> None:
    """The runs' logs and databases, as one file (the device tool brings back a few files only)."""
    if OUT is not None and (OUT / "logs").is_dir():
        shutil.make_archive(str(OUT / "runs"), "gztar", root_dir=str(OUT), base_dir="logs")
        shutil.rmtree(OUT / "logs")
