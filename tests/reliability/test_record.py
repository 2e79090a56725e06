"""`kvtrace record` itself under signals, without vLLM: fast checks of what test_reliability_signals.py
and test_reliability_kill.py show on real vLLM runs (exit status = the child's, a second SIGINT leaves
no process of the group, signals only ever go to the recorded command's processes). See
docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.reliability_util import group_gone, group_members, manifest, start_record, wait_until

# A recorded command: writes its pid, then waits. MODE says how it treats SIGINT/SIGTERM.
CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    mode = sys.argv[1]
    if mode == "exit3":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))
    if mode == "stubborn":  # ignores SIGINT and SIGTERM, and has a grandchild in its group
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(300)"])
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(300)
""")


def record_child(tmp_path, mode: str, sigint_ignored: bool = False):
    ready = tmp_path / f"{mode}.pid"
    rec = start_record(tmp_path / mode, [sys.executable, "-c", CHILD, mode, str(ready)],
                       sigint_ignored=sigint_ignored)
    wait_until(ready.exists, 60, "the child to start", rec, every=0.05)
    rec.child()
    return rec


@pytest.mark.parametrize("mode,sig,child_status", [
    ("exit3", signal.SIGTERM, 3),            # the child handles it its way: its status is kvtrace's
    ("default", signal.SIGINT, -signal.SIGINT),  # killed by the signal: 128 + N, as a shell reports
    ("default", signal.SIGTERM, -signal.SIGTERM),
])
def test_signal_is_passed_on_and_record_exits_with_the_childs_status(tmp_path, mode, sig, child_status):
    rec = record_child(tmp_path, mode)
    try:
        rec.proc.send_signal(sig)
        code = rec.wait(timeout=60)
        assert code == (128 - child_status if child_status < 0 else child_status)
        doc = manifest(rec.session)
        # An error exit is not a complete run; a clean one that started no vLLM recorded nothing: "empty".
        status = "incomplete" if child_status == 3 else "empty"
        assert doc["exit_code"] == child_status and doc["status"] == status
        assert group_gone(rec.child_pgid)
        lines = rec.stderr.strip().splitlines()
        assert f"kvtrace: session {rec.session} ({status}, exit {child_status})" in lines
        assert lines[-1].startswith("kvtrace:   no vLLM process was recorded"), lines[-3:]
    finally:
        rec.kill_all()


def test_sigint_reaches_the_command_when_record_started_with_sigint_ignored(tmp_path):
    """A non-interactive shell starts `kvtrace record ... &` with SIGINT ignored, and an ignored signal
    is inherited across exec: the recorded command must still get SIGINT's default action, since
    record forwards SIGINT to it (record's own handler is installed before the command starts, and a
    handler, unlike "ignore", is reset to the default in the new program)."""
    rec = record_child(tmp_path, "default", sigint_ignored=True)
    try:
        rec.proc.send_signal(signal.SIGINT)
        assert rec.wait(timeout=60) == 128 + signal.SIGINT
        assert manifest(rec.session)["exit_code"] == -signal.SIGINT
        assert group_gone(rec.child_pgid)
    finally:
        rec.kill_all()


def test_second_sigint_kills_the_whole_group(tmp_path):
    rec = record_child(tmp_path, "stubborn")
    try:
        wait_until(lambda: len(group_members(rec.child_pgid)) >= 2, 30, "the grandchild", rec)
        rec.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert rec.proc.poll() is None and len(group_members(rec.child_pgid)) >= 2  # ignored, as it chose
        t0 = time.monotonic()
        rec.proc.send_signal(signal.SIGINT)
        code = rec.wait(timeout=30)
        assert time.monotonic() - t0 < 10
        assert code == 128 + signal.SIGKILL
        assert group_gone(rec.child_pgid), group_members(rec.child_pgid)
        assert manifest(rec.session)["status"] == "incomplete"
    finally:
        rec.kill_all()


def test_flush_request_never_signals_a_process_outside_the_recording(tmp_path):
    """A recorded process that died long ago (OOM-killed, say) stays `running` in its proc.json; its pid
    may since belong to anything. Passing on Ctrl-C, kvtrace asks recording processes to flush with
    SIGUSR2, whose default action is to terminate: it must only ever go to the recorded command's group."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        rec = record_child(tmp_path, "default")
        try:
            stale = rec.session / "procs" / f"{socket.gethostname()}-{bystander.pid}"
            stale.mkdir(parents=True)
            (stale / "proc.json").write_text(json.dumps({"pid": bystander.pid, "role": "worker", "status": "running",
                                                         "host": socket.gethostname()}))
            rec.proc.send_signal(signal.SIGINT)
            rec.wait(timeout=60)
        finally:
            rec.kill_all()
        time.sleep(0.5)
        assert bystander.poll() is None, f"kvtrace killed an unrelated process (exit {bystander.returncode})"
    finally:
        bystander.kill()
        bystander.wait()


def test_record_of_a_command_that_cannot_start_is_one_line(tmp_path):
    from tests.helpers.run import run_kvtrace

    res = run_kvtrace("record", "-o", str(tmp_path / "s"), "--", str(tmp_path), check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("kvtrace: error: ")


def test_environment_and_command_line_redaction(tmp_path):
    from kvtrace.format.session import new_manifest

    os.environ["HF_TOKEN"] = "hf-secret-value"
    try:
        doc = new_manifest(["vllm", "serve", "m", "--api-key", "k1", "--hf-token=k2", "--port", "8000",
                            "--password", "p"], {})
    finally:
        del os.environ["HF_TOKEN"]
    assert doc["command"] == ["vllm", "serve", "m", "--api-key", "<redacted>", "--hf-token=<redacted>", "--port",
                              "8000", "--password", "<redacted>"]
    assert doc["env"]["HF_TOKEN"] == "<redacted>"
    assert "hf-secret-value" not in json.dumps(doc) and "k1" not in doc["command"]


@pytest.mark.parametrize("argv, hidden, kept", [
    (["sh", "-c", "vllm serve m --verbose --api-key abc1 --port 8000"], ["abc1"], ["--port 8000", "--verbose"]),
    (["sh", "-c", "vllm serve m --api-key='a b c' --port 8000"], ["a b c"], ["--port 8000"]),
    (["env", "HF_TOKEN=hf_x1", "OPENAI_API_KEY=sk-x2", "vllm", "serve", "m"], ["hf_x1", "sk-x2"], ["vllm"]),
    (["python", "run.py", "--url", "https://user:pw1@host.example/x"], ["user:pw1"], ["host.example/x"]),
    (["vllm", "serve", "m", "--max-num-batched-tokens", "512", "--ssl-keyfile", "/k.pem", "--tokenizer", "t"],
     [], ["512", "/k.pem", "t"]),
])
def test_redaction_by_what_a_value_is(argv, hidden, kept):
    """Secrets inside shell strings, assignments and URLs go; values of harmless options whose names
    merely contain a secret-like word (batched *tokens*, ssl *keyfile*) stay."""
    from kvtrace.format.session import redact_argv

    text = json.dumps(redact_argv(argv))
    assert all(h not in text for h in hidden), text
    assert all(k in text for k in kept), text


def test_environment_urls_lose_their_credentials():
    from kvtrace.format.session import redact_env

    env = redact_env({"HF_ENDPOINT": "https://me:pw2@hub.example/api", "VLLM_MAX_TOKENS": "5", "VLLM_API_KEY": "k"})
    assert env == {"HF_ENDPOINT": "https://<redacted>@hub.example/api", "VLLM_MAX_TOKENS": "5",
                   "VLLM_API_KEY": "<redacted>"}
