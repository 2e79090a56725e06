"""Per-layer KV access records from a real vLLM run (CPU backend, the CPU ring) against the scheduler's
own blocks: for every step and layer, the blocks read are the first ceil(seq_len / block_size) blocks of
each request's block table, and the slots written are the tokens scheduled that step
(tests/helpers/kv_checks.py rebuilds the tables from the block pool events, without the attention probe).
"""

from __future__ import annotations

import json

import duckdb
import pytest

from tests.helpers.kv_checks import check_reads_and_writes, expected_records
from tests.helpers.run import record_workload

pytestmark = [pytest.mark.vllm, pytest.mark.exactness]
BLOCK = 32
MLA_BLOCK = 16  # the CPU MLA kernel's only block size


def test_reads_and_writes_match_scheduler_blocks(recorded_run):
    con = duckdb.connect(str(recorded_run["db"]), read_only=True)
    try:
        layers = [r[0] for r in con.execute("select distinct layer from kv_access order by 1").fetchall()]
        assert layers == [0, 1]  # the tiny model's two attention layers, all recorded
        assert check_reads_and_writes(con, BLOCK, layers) > 500
    finally:
        con.close()


def have_cpu_mla() -> bool:
    """vLLM's CPU build has an MLA backend (CPU_MLA) from 0.30."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.attention.backends.mla.cpu_mla") is not None


@pytest.fixture(scope="module")
def mla_run(tiny_model, tmp_path_factory) -> dict:
    """The standard workload on a tiny DeepSeek-V2 (Multi-head Latent Attention, random weights), on vLLM's
    CPU MLA backend (block size 16, the one its kernel takes)."""
    if not have_cpu_mla():
        pytest.skip("this vLLM's CPU build has no MLA backend (CPU_MLA: vLLM 0.30 and later)")
    from kvtrace.demo.model import ensure_tiny_mla_model

    tmp = tmp_path_factory.mktemp("mla")
    model = ensure_tiny_mla_model(tmp / "tiny-mla", layers=2)
    engine = {"load_format": "dummy", "block_size": MLA_BLOCK, "max_model_len": 768, "attention_config": {"backend": "CPU_MLA"}}
    return record_workload(tmp, "mla", str(model), ["--num-blocks", "50", "--engine-args", json.dumps(engine)],
                           ["--kv-granularity", "blocks", "--kv-layers", "all"])



def test_mla_reads_and_writes_match_scheduler_blocks(mla_run):
    """MLA's metadata splits the batch into decode and prefill parts and keeps no whole-batch block table
    or sequence lengths: the probe reads them from the CommonAttentionMetadata its builder was given."""
    con = duckdb.connect(str(mla_run["db"]), read_only=True)
    try:
        probes = con.execute("select role, status, reason from probes where probe = 'attention' "
                             "and role = 'worker'").fetchall()
        assert probes == [("worker", "attached", "")], probes
        layers = [r[0] for r in con.execute("select distinct layer from kv_access order by 1").fetchall()]
        assert layers == [0, 1]
        assert check_reads_and_writes(con, MLA_BLOCK, layers) > 500
        (records,), = con.execute("select count(*) from kv_access").fetchall()
        assert records == expected_records(con, MLA_BLOCK, 2)
        (requests,), = con.execute("select count(*) from requests").fetchall()
        (preemptions,), = con.execute("select count(*) from preemptions").fetchall()
    finally:
        con.close()
    vllm = mla_run["metrics"]["vllm"]
    assert requests == 18 and preemptions == vllm["num_preemptions"] > 0


def test_a_fault_in_the_attention_probe_switches_off_that_probe_only(tiny_model, tmp_path):
    """The attention probe raising inside vLLM's forward pass (`inject_fault`) is switched off for the
    rest of the run, said in its status: the engine finishes every request and the host probes record
    as ever, no KV access rows beyond what was recorded before the fault."""
    run = record_workload(tmp_path, "fault", tiny_model, ["--num-blocks", "40"],
                          ["--options-json", json.dumps({"inject_fault": "attention"})])
    con = duckdb.connect(str(run["db"]), read_only=True)
    try:
        (status, reason), = con.execute("select status, reason from probes where probe = 'attention' "
                                        "and role = 'worker'").fetchall()
        assert status == "failed" and reason.startswith("RuntimeError: injected fault in probe attention"), reason
        (accesses,), = con.execute("select count(*) from kv_access").fetchall()
        (requests, steps), = con.execute("select (select count(finish_ns) from requests), "
                                         "(select count(*) from steps)").fetchall()
        (session_status,), = con.execute("select status from sessions").fetchall()
    finally:
        con.close()
    assert accesses == 0 and requests == 18 and steps > 100
    assert session_status != "complete"  # a failed probe is never a complete recording
