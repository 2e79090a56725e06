"""The two-GPU side-by-side throughput of bench/bench_gpu_throughput.py (`--gpu-pairs`): which runs each
turn pairs, and the ratio its report reads from them (the GPU run itself is on the GPU machine)."""

from __future__ import annotations

import argparse
import re
from collections import Counter

import pytest

from tests.helpers.run import bench_module


@pytest.fixture(scope="module")
def bgt():
    return bench_module("bench_gpu_throughput")


def test_every_variant_meets_plain_on_both_sides_in_rotating_order(bgt):
    turns = bgt.pair_turns(["plain", "default", "all-layers", "plain-2"], reps=4)
    assert [t for t, _v, _s in turns] == list(range(12))
    # each repetition pairs every other variant with plain once, the order rotating, the sides swapping
    assert [v for _t, v, _s in turns] == ["default", "all-layers", "plain-2", "all-layers", "plain-2", "default",
                                          "plain-2", "default", "all-layers", "default", "all-layers", "plain-2"]
    assert [s for _t, _v, s in turns] == [0] * 3 + [1] * 3 + [0] * 3 + [1] * 3
    assert Counter((v, s) for _t, v, s in turns) == {(v, s): 2 for v in ("default", "all-layers", "plain-2")
                                                     for s in (0, 1)}


def test_the_cpus_split_in_two_halves(bgt, monkeypatch):
    monkeypatch.setattr(bgt.os, "sched_getaffinity", lambda pid: set(range(32)))
    assert bgt.pair_sides() == [list(range(16)), list(range(16, 32))]
    monkeypatch.setattr(bgt.os, "sched_getaffinity", lambda pid: {3})
    assert bgt.pair_sides() == [[3], [3]]


def test_the_report_pairs_each_run_with_plain_of_its_turn(bgt):
    turns = bgt.pair_turns(["plain", "default"], reps=4)
    # the machine slows down by half from turn to turn; the recorded run is 2% slower than plain beside it
    speed = [1.0, 0.5, 1.0, 0.5]
    plain = {0: [], 1: []}
    default = {0: [], 1: []}
    for turn, _v, side in turns:
        tokens = 1000
        default[side].append({"turn": turn, "seconds": 1.0 / (speed[turn] * 0.98), "output_tokens": tokens,
                              "engine_cpu_s": 1.1, "steps": 100})
        plain[1 - side].append({"turn": turn, "seconds": 1.0 / speed[turn], "output_tokens": tokens,
                                "engine_cpu_s": 1.0, "steps": 100})
    runs = {f"{v}@{g}": {"reps": reps[g]} for v, reps in (("plain", plain), ("default", default)) for g in (0, 1)}
    args = argparse.Namespace(num_prompts=256, input_len=512, output_len=256, reps=4)
    lines = bgt.pairs_report("1b", {"turns": turns, "runs": runs, "sides": [[0, 1], [2, 3]]}, args)
    line = next(x for x in lines if x.strip().startswith("default / plain"))
    assert re.search(r"4 pairs: 0\.9800 \[0\.9800, 0\.9800\]", line), line
    assert "on GPU 0: 0.9800 (2), on GPU 1: 0.9800 (2)" in line
    assert "spread of a pair's log ratio 0.0% (plain's own from turn to turn 69.3% rms)" in line
    assert "EngineCore CPU per step 10.00 -> 11.00 ms" in line
