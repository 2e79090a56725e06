"""`kvtrace record -- vllm bench throughput ...`: the third kind of launch (after `vllm serve` and a script
using `LLM`) records every request of the benchmark, checked against the benchmark's own JSON report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.run import query, run_kvtrace

NUM_PROMPTS = 12


@pytest.mark.vllm
def test_vllm_bench_throughput_is_recorded(tiny_model, tmp_path):
    session, db, report = tmp_path / "bench", tmp_path / "bench.duckdb", tmp_path / "bench.json"
    vllm = str(Path(sys.executable).parent / "vllm")
    # The tiny tokenizer re-encodes the random dataset's text into more tokens than asked for: a long
    # max_model_len keeps every prompt admissible.
    run_kvtrace("record", "-o", str(session), "--", vllm, "bench", "throughput", "--model", tiny_model,
                "--dataset-name", "random", "--input-len", "32", "--output-len", "8",
                "--num-prompts", str(NUM_PROMPTS), "--dtype", "float32", "--max-model-len", "4096",
                "--enforce-eager", "--block-size", "32", "--output-json", str(report), timeout=900)
    bench = json.loads(report.read_text())
    manifest = json.loads((session / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["exit_code"] == 0
    assert manifest["engine_config"]["block_size"] == 32
    run_kvtrace("ingest", str(session), "-o", str(db))
    summary = json.loads(run_kvtrace("query", str(db), "summary", "--format", "json").stdout)[0]
    assert summary["requests"] == bench["num_requests"] == NUM_PROMPTS
    assert summary["steps"] > 0 and summary["block_allocs"] > 0 and summary["dropped_events"] == 0
    assert summary["probes_disabled"] is None  # "unused" (attention outside workers) is not disabled
    # vLLM computes every prompt and output token the benchmark counts (total_num_tokens).
    [(prompt, output)] = query(db, "SELECT sum(prompt_tokens), sum(output_tokens) FROM requests")
    assert prompt + output == bench["total_num_tokens"]
    assert query(db, "SELECT count(DISTINCT step) FROM step_requests")[0][0] > 0
