"""Per-layer KV access records from a real vLLM run (CPU backend, the CPU ring) against the scheduler's
own blocks: for every step and layer, the blocks read are the first ceil(seq_len / block_size) blocks of
each request's block table, and the slots written are the tokens scheduled that step
(tests/helpers/kv_checks.py rebuilds the tables from the block pool events, without the attention probe).
"""

from __future__ import annotations

import duckdb
import pytest

from tests.helpers.kv_checks import check_reads_and_writes

pytestmark = [pytest.mark.vllm, pytest.mark.exactness]
BLOCK = 32


def test_reads_and_writes_match_scheduler_blocks(recorded_run):
    con = duckdb.connect(str(recorded_run["db"]), read_only=True)
    try:
        layers = [r[0] for r in con.execute("select distinct layer from kv_access order by 1").fetchall()]
        assert layers == [0, 1]  # the tiny model's two attention layers, all recorded
        assert check_reads_and_writes(con, BLOCK, layers) > 500
    finally:
        con.close()
