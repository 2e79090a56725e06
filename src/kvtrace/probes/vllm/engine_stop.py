"""Engine-stop probe (front end): the engine processes write what they hold before vLLM stops them.

vLLM's front end stops its EngineCore processes with `vllm.v1.engine.utils.shutdown(procs, timeout)`:
SIGTERM, then SIGKILL once `timeout` has passed, and the offline `LLM`'s timeout is 0. An engine that
is still busy when the SIGTERM comes (its own graceful stop, `EngineCore.shutdown`, closes the recording,
see probes/vllm/scheduler.py) is killed before it can, and so is its worker: their last rows are lost and the
session is `incomplete`. Seen in about one `vllm bench throughput` run in three on this machine
(tests/integration/test_launch_vllm_bench.py).

The wrapper first asks those processes and their descendants to flush (SIGUSR2, the signal
`kvtrace record` sends on Ctrl-C; `Recorder` writes everything it holds and marks itself `flushed`),
waits for them to say so (at most `FLUSH_WAIT_S`), then lets vLLM stop them as it would have. A
process that is not recording, or has already closed, is not signalled.
"""

from __future__ import annotations

from typing import Any

from kvtrace.probes.base import Probe

ENGINE_UTILS = "vllm.v1.engine.utils"
FLUSH_WAIT_S = 2.0  # seconds the stop may be delayed, at most, while the engines flush




class EngineStopProbe(Probe):
    name = "engine_stop"
    defer_until = ENGINE_UTILS  # installs in the processes that load it (front ends), imports nothing

    @classmethod
    def targets(cls):
        return [(ENGINE_UTILS, "shutdown", ("procs", "timeout"))]

    def install_patches(self) -> None:
        import importlib

        module = importlib.import_module(ENGINE_UTILS)
        probe = self

        def make(orig):
            def shutdown(procs, *args, **kwargs):
                if probe.enabled:
                    try:
                        probe.flush_before_stop(procs)
                    except Exception as exc:
                        probe.fail(exc)
                return orig(procs, *args, **kwargs)  # whatever else vLLM passes, passed on as given
            return shutdown

        self.patch(module, "shutdown", make)

    def flush_before_stop(self, procs: Any) -> None:
        from kvtrace.record.signals import descendants, request_flush

        pids = {p.pid for p in procs if p.pid is not None and p.is_alive()}
        if pids:
            request_flush(self.rec.session_dir, timeout_s=FLUSH_WAIT_S, pids=descendants(pids))
