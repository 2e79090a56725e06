"""Run a function when a module is imported, without importing it ourselves.

A probe whose target lives in a heavy module (the model runner: ~0.6 s to import on this CPU build)
must not import it in every vLLM process just to patch it: the front end and the EngineCore never load
it. `when_imported(name, fn)` calls `fn(module)` at once if the module is loaded, else right after the
module's own code has run, the first time anything imports it (a finder at the head of
`sys.meta_path` that wraps the module's loader; the import itself is left to Python's finders).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _ImportWatcher(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.waiting: dict[str, list[Callback]] = {}
        self.lock = threading.Lock()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
            return None
        for finder in sys.meta_path:  # the spec the import would have used
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_notify(module: ModuleType) -> None:
            exec_module(module)
            self.notify(fullname, module)

        try:
            loader.exec_module = exec_then_notify  # this spec's own loader instance
        except AttributeError:  # a loader that takes no attributes: watch nothing, import normally
            return spec
        return spec

    def notify(self, name: str, module: ModuleType) -> None:
        with self.lock:
            callbacks = self.waiting.pop(name, [])
        for fn in callbacks:
            try:
                fn(module)
            except Exception as exc:  # an import must never fail because of a probe
                print(f"kvtrace: warning: after importing {name}: {exc!r}", file=sys.stderr)


_watcher = _ImportWatcher()


def when_imported(name: str, fn: Callback) -> bool:
    """Call `fn(module)` now if `name` is imported, else once it is. Returns False (and never calls
    `fn`) when no such module can be found, so the caller can report the target as missing."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return True
    try:
        if importlib.util.find_spec(name) is None:  # imports parent packages only (light)
            return False
    except (ImportError, ValueError):
        return False
    with _watcher.lock:
        _watcher.waiting.setdefault(name, []).append(fn)
        if _watcher not in sys.meta_path:
            sys.meta_path.insert(0, _watcher)
    module = sys.modules.get(name)  # imported by another thread meanwhile
    if module is not None:
        _watcher.notify(name, module)
    return True
