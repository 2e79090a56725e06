"""The generated hostile-input corpus (tests/reliability/hostile.py), several hundred cases over every
kind of file kvtrace reads: each ends in one `kvtrace: error:` line with exit 1, or in exit 0 with
the data the undamaged parts hold; no file outside the command's outputs changes; no network call is
made; the runner's memory stays under its address-space limit. Failures list the cases by name; rerun
one with `python -m tests.reliability.hostile ROOT` and `kvtrace <argv from ROOT/cases.json>`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.hostile import MEMORY_LIMIT_BYTES, REPO, Corpus

FAMILIES = ("manifest", "proc", "json", "special", "double", "foreign", "shard", "job", "db", "ds", "nsys")


def isolated() -> list[str]:
    """`unshare -n` (a network namespace with no interfaces) where this machine allows it, else nothing:
    the runner also refuses every socket call made from Python."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-n"]
    return []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hostile")
    cases = Corpus(root).build()
    results = root / "results.json"
    proc = subprocess.run([*isolated(), sys.executable, "-m", "tests.reliability.hostile", "--run", str(root),
                           str(results)], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    spec = json.loads((root / "cases.json").read_text())
    out = json.loads(results.read_text())
    return {"cases": {c["name"]: c for c in cases}, "base": spec["base_held"], **out}


def failures(corpus: dict, family: str) -> list[str]:
    bad = []
    for r in corpus["results"]:
        case = corpus["cases"][r["name"]]
        if case["family"] != family:
            continue
        lines = r["stderr"].strip().splitlines()
        refused = r["code"] == 1 and len(lines) == 1 and lines[0].startswith("kvtrace: error: ")
        loaded = r["code"] == 0 and (
            not case["whole"] or r["held"] == corpus["base"]
            or (case["whole"] == "rows" and isinstance(r["held"], dict)
                and {t: v[0] for t, v in r["held"].items()} == {t: v[0] for t, v in corpus["base"].items()}))
        why = []
        if r["escaped"]:
            why.append(f"escaped kvtrace's handling: {r['escaped']}")
        if not (refused or loaded):
            why.append(f"exit {r['code']}, {len(lines)} stderr lines: {lines[-1][:200] if lines else ''}"
                       + ("; data differs" if r["code"] == 0 else ""))
        if r["changed"]:
            why.append(f"changed files outside its outputs: {r['changed']}")
        if r["network"]:
            why.append(f"network: {r['network']}")
        if why:
            bad.append(f"{r['name']} ({' '.join(case['argv'][:1])}): {'; '.join(why)}")
    return bad


def test_the_corpus_covers_every_kind_of_input(corpus):
    per = {f: sum(c["family"] == f for c in corpus["cases"].values()) for f in FAMILIES}
    assert len(corpus["cases"]) >= 300 and all(n >= 5 for n in per.values()), per
    assert len(corpus["results"]) == len(corpus["cases"])
    # Both outcomes occur: a corpus where everything is refused (or accepted) would test little.
    codes = {r["code"] for r in corpus["results"]}
    assert codes == {0, 1}, codes


@pytest.mark.parametrize("family", FAMILIES)
def test_every_case_is_one_line_or_correct_data(corpus, family):
    bad = failures(corpus, family)
    assert not bad, f"{len(bad)} case(s):\n" + "\n".join(bad[:30])


def test_memory_stays_under_the_runners_limit(corpus):
    """The runner ran every case under RLIMIT_AS = MEMORY_LIMIT_BYTES (a case over it would have failed
    with MemoryError, reported above); its peak resident memory is reported here."""
    assert corpus["memory_limit_bytes"] == MEMORY_LIMIT_BYTES
    assert 0 < corpus["max_rss_bytes"] < MEMORY_LIMIT_BYTES


def test_cases_are_quick(corpus):
    slow = [(r["name"], r["seconds"]) for r in corpus["results"] if r["seconds"] > 20]
    assert not slow, slow


def test_refusals_name_what_they_refused(corpus):
    """A one-line error names the file or option it is about (its path, or the option's name)."""
    unnamed = []
    for r in corpus["results"]:
        if r["code"] != 1:
            continue
        argv = corpus["cases"][r["name"]]["argv"]
        line = r["stderr"].strip()
        named = [a for a in argv[1:] if "/" in a] + [a for a in argv if a.startswith("--")]
        if not any(Path(a).name in line or a in line for a in named):
            unnamed.append(f"{r['name']}: {line[:160]}")
    assert not unnamed, "\n".join(unnamed[:20])
