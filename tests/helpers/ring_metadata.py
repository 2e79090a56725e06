"""vLLM-shaped attention metadata for the KV access ring tests (CPU and GPU) and bench/bench_device_ring.py,
and the plain-Python reference records they are checked against."""

from __future__ import annotations

import random

import torch

from kvtrace.record.recorder import MemoryRecorder


# ---- the reference: the spec, one token and one block at a time --------------------------------------
def reference_records(slot_mapping, block_table, seq_lens, query_start_loc, block_size):
    """[(op, slot, block_id, token_offset, token_count)] for one layer call, written from the definition."""
    sm = [int(x) for x in slot_mapping]
    R = len(seq_lens)
    qsl = None if query_start_loc is None else [int(x) for x in query_start_loc][: R + 1]

    def zone(t):  # the request whose query range holds t; -1 before the first, R after the last
        if qsl is None:
            return R
        z = -1
        for i, start in enumerate(qsl):
            if start <= t:
                z = i
        return z

    out = []
    t = 0
    while t < len(sm):
        s = sm[t]
        if s < 0:
            t += 1
            continue
        z = zone(t)
        k = 1
        while (t + k < len(sm) and sm[t + k] == s + k and (s + k) % block_size != 0
               and zone(t + k) == z):
            k += 1
        out.append((1, z if 0 <= z < R else -1, s // block_size, s % block_size, k))
        t += k
    for r in range(R):
        length = int(seq_lens[r])
        for j in range(len(block_table[r])):
            if j * block_size >= length:
                break
            out.append((0, r, int(block_table[r][j]), 0, min(block_size, length - j * block_size)))
    return out


def make_metadata(rng: random.Random, num_reqs=12, block_size=16, max_blocks=24, pad_tokens=5, pad_reqs=2,
                  slot_dtype=torch.int64):
    """vLLM-shaped attention metadata: decodes, fresh prefills and chunked prefills in one batch, block ids
    drawn without replacement, slot_mapping padded with -1 and padded requests of seq_len 0."""
    pool = list(range(1, 4 * num_reqs * max_blocks))
    rng.shuffle(pool)
    rows, seq_lens, slots, qsl = [], [], [], [0]
    for _ in range(num_reqs):
        kind = rng.choice(["decode", "decode", "prefill", "chunk"])
        cap = max_blocks * block_size
        if kind == "decode":
            computed, q = rng.randrange(0, cap - 1), 1
        elif kind == "prefill":
            computed, q = 0, rng.randrange(1, min(cap, 3 * block_size + 5))
        else:
            computed = rng.randrange(1, cap // 2)
            q = rng.randrange(1, min(cap - computed, 2 * block_size + 7))
        L = computed + q
        nb = -(-L // block_size)
        row = [pool.pop() for _ in range(nb)] + [0] * (max_blocks - nb)
        rows.append(row)
        seq_lens.append(L)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(computed, L)]
        qsl.append(qsl[-1] + q)
    for _ in range(pad_reqs):  # CUDA-graph padding: empty requests
        rows.append([0] * max_blocks)
        seq_lens.append(0)
        qsl.append(qsl[-1])
    slots += [-1] * pad_tokens
    return (torch.tensor(slots, dtype=slot_dtype), torch.tensor(rows, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32))


def chaotic_metadata(rng: random.Random, block_size=4):
    """Arbitrary slots (-1 anywhere, repeats, jumps, runs across blocks and requests), empty requests in
    the middle, and block tables narrower than the context: the run rules at their edges."""
    R = rng.randrange(1, 7)
    q = [rng.choice([0, 1, 2, 5, 9]) for _ in range(R)]
    qsl = [0]
    for x in q:
        qsl.append(qsl[-1] + x)
    T = qsl[-1] + rng.randrange(0, 4)
    slots, s = [], rng.randrange(0, 40)
    for _ in range(T):
        r = rng.random()
        s = -1 if r < 0.15 else (s + 1 if r < 0.75 else rng.randrange(0, 40))
        slots.append(s if s >= 0 else -1)
        if s < 0:
            s = rng.randrange(0, 40)
    M = rng.randrange(1, 6)
    bt = [[rng.randrange(0, 100) for _ in range(M)] for _ in range(R)]
    sl = [rng.randrange(0, 30) for _ in range(R)]
    return (torch.tensor(slots, dtype=torch.int64), torch.tensor(bt, dtype=torch.int32),
            torch.tensor(sl, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32))


def kv_rows(rec: MemoryRecorder):
    return rec.buffers.get("kv_access", [])


def strip_ts(rows):
    """kv_access rows without ts_ns, as (step, layer, op, slot, block_id, token_offset, token_count)."""
    return [(r[0], r[1], r[3], r[4], r[5], r[6], r[7]) for r in rows]


def expected_rows(step, layer, meta, block_size):
    return [(step, layer, *rec) for rec in reference_records(*meta, block_size)]
