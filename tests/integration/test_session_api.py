"""The README's Python example, as written: `with kvtrace.session(...)` around an `LLM` the script keeps,
then `ingest`: the session is complete and holds the engine's steps, though the engine is still alive
when the block ends."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.run import VLLM_ENV, query

pytestmark = pytest.mark.vllm

SCRIPT = """
import json, sys
import kvtrace
from vllm import LLM, SamplingParams

if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    with kvtrace.session(sys.argv[2]):
        llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, enforce_eager=True, block_size=32,
                  num_gpu_blocks_override=64)
        outs = llm.generate(["a kv cache block", "a kv cache block prefix"], SamplingParams(max_tokens=8))

    from kvtrace.ingest import ingest
    report = ingest([sys.argv[2]], sys.argv[3])
    print("RESULT", json.dumps({"status": report[0]["status"], "problems": report[0]["problems"],
                                "outputs": len(outs)}), flush=True)
"""


def test_the_python_example_records_a_whole_session(tiny_model, tmp_path):
    import os

    script = tmp_path / "example.py"
    script.write_text(SCRIPT)
    session, db = tmp_path / "run1", tmp_path / "run1.duckdb"
    proc = subprocess.run([sys.executable, str(script), tiny_model, str(session), str(db)], capture_output=True,
                          text=True, env={**os.environ, **VLLM_ENV}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]  # vLLM logs to stdout too
    result = json.loads(line[len("RESULT "):])
    assert result == {"status": "complete", "problems": [], "outputs": 2}, proc.stderr[-3000:]
    (steps, requests), = query(db, "select (select count(*) from steps), (select count(*) from requests)")
    assert steps > 0 and requests == 2
    manifest = json.loads((session / "manifest.json").read_text())
    assert manifest["status"] == "complete"
