"""vLLM's hooks checked against its source without importing it (probes/vllm/source.py): the same
answers as on the imported release, the support table generated from the releases' skeletons, and
every release from 0.26 to 0.33 attaching every probe."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from kvtrace.errors import KvtraceError
from kvtrace.probes.base import TargetMissing
from kvtrace.probes.vllm.doctor import check, table
from kvtrace.probes.vllm.source import VllmSource

REPO = Path(__file__).resolve().parents[3]
SKELETONS = sorted((REPO / "tests" / "data" / "vllm_skeletons").glob("*.json"))

SCHED = '''
from vllm.base import Base

class Scheduler(Base):
    def schedule(self):
        pass

    def add_request(self, request, *, priority=0):
        pass
'''
BASE = '''
from vllm.util import shutdown

class Base:
    def _free_request(self, request):
        pass

    def schedule(self, unused):
        pass
'''
UTIL = '''
def shutdown(procs, timeout):
    pass
'''


@pytest.fixture
def wheel(tmp_path) -> Path:
    path = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/sched.py", SCHED)
        z.writestr("vllm/base.py", BASE)
        z.writestr("vllm/util.py", UTIL)
        z.writestr("vllm-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    return path


def test_targets_are_found_as_an_import_would_find_them(wheel):
    src = VllmSource(wheel)
    assert src.version == "9.9.9"
    src.check_targets([("vllm.sched", "Scheduler.schedule", ()),  # its own, not its base's
                       ("vllm.sched", "Scheduler.add_request", ("request", "priority")),
                       ("vllm.sched", "Scheduler._free_request", ("request",)),  # inherited
                       ("vllm.base", "shutdown", ("procs", "timeout"))])  # imported into the module
    for target, message in [
        (("vllm.sched", "Scheduler.missing", ()), "vllm.sched.Scheduler.missing not found (no attribute 'missing')"),
        (("vllm.sched", "Other.x", ()), "vllm.sched.Other.x not found (no attribute 'Other')"),
        (("vllm.sched", "Scheduler.add_request", ("req",)), "signature changed, missing parameter(s) req"),
        (("vllm.nowhere", "f", ()), "cannot import vllm.nowhere: not in the source"),
    ]:
        with pytest.raises(TargetMissing, match=message.replace("(", r"\(").replace(")", r"\)")):
            src.check_targets([target])


def test_a_skeleton_answers_as_its_source_does(wheel, tmp_path):
    targets = [("vllm.sched", "Scheduler._free_request", ("request",)), ("vllm.base", "shutdown", ())]
    doc = VllmSource(wheel).skeleton(targets)
    assert doc == {"vllm": "9.9.9", "modules": {
        "vllm.base": {"shutdown": ["procs", "timeout"]},
        "vllm.sched": {"Scheduler": None, "Scheduler._free_request": ["self", "request"]}}}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    VllmSource(tmp_path / "s.json").check_targets(targets)


def test_bad_sources_are_one_line_errors(tmp_path):
    (tmp_path / "x.json").write_text("[1, 2]")
    (tmp_path / "x.whl").write_bytes(b"not a zip")
    for bad in (tmp_path / "x.json", tmp_path / "x.whl", tmp_path):
        with pytest.raises(KvtraceError) as err:
            VllmSource(bad)
        assert "\n" not in str(err.value) and str(bad) in str(err.value)


@pytest.mark.parametrize("skeleton", SKELETONS, ids=[p.stem for p in SKELETONS])
def test_every_release_attaches_every_probe(skeleton):
    report = check(str(skeleton))
    assert report["ok"] and {p["status"] for p in report["probes"]} == {"attached"}, report
    hooks = {(p["probe"], h["hook"]): h["detail"] for p in report["probes"] for h in p["hooks"]}
    old = skeleton.stem in ("0.26.0", "0.27.0", "0.30.0")
    assert ("_select_waiting_queue_for_scheduling" in hooks[("scheduler", "admission")]) == old
    assert ("get_computed_blocks" in hooks[("prefix_cache", "lookup")]) == (skeleton.stem == "0.26.0")


def test_the_support_table_is_generated_from_the_skeletons():
    doc = (REPO / "docs" / "vllm-support.md").read_text()
    assert doc == table([str(p) for p in SKELETONS]), "regenerate: make support-doc"
