"""Version drift on purpose: alter vLLM in a child process before kvtrace's plugin checks its targets.

Put this directory on the recorded command's PYTHONPATH (tests/reliability/test_drift.py does). Python
imports `sitecustomize` at start-up in every process, vLLM's spawned EngineCore and workers included; it
does nothing unless KVTRACE_TEST_DRIFT names an alteration:

  touch-signature   BlockPool.touch becomes `touch(self, *args, **kwargs)`: vLLM works as before (it calls
                    it positionally), but the parameter `blocks` the kv_blocks probe reads is gone from the
                    signature, as when a release renames a parameter.

The alteration is made when vLLM's module is first imported (an import hook), so processes that never
import it (and the start-up of those that do) are not slowed down.
"""

import os
import sys

_WHAT = os.environ.get("KVTRACE_TEST_DRIFT", "")
_MODULE = "vllm.v1.core.block_pool"


def _alter(module) -> None:
    if "touch-signature" in _WHAT.split(","):
        pool = module.BlockPool
        original = pool.touch

        def touch(self, *args, **kwargs):
            return original(self, *args, **kwargs)

        pool.touch = touch


if _WHAT:
    import importlib.abc
    import importlib.util

    class _DriftHook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != _MODULE:
                return None
            sys.meta_path.remove(self)  # once: find the real module, then get out of the way
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_alter(module):
                exec_module(module)
                _alter(module)

            spec.loader.exec_module = exec_and_alter
            return spec

    sys.meta_path.insert(0, _DriftHook())
