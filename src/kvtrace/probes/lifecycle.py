"""The probes installed in this process, whatever the engine: closing them, and letting them hand over
what they hold. Nothing here may raise into the engine.

Imports nothing heavy at module level: an engine's plugin loader imports this in every process, traced
or not.
"""

from __future__ import annotations

import atexit
from typing import Any

_installed: list = []
_hooked = False  # close_probes registered with the recorder and atexit


def install(probes: list[Any]) -> None:
    """Keep `probes` (installed already) for close/take, and have the recorder close them before it
    writes on a "flush now" signal and at exit."""
    global _hooked
    from kvtrace.record.recorder import add_flush_hook

    _installed.extend(probes)
    if not _hooked:
        _hooked = True
        add_flush_hook(close_probes)  # pending step rows, device rings: before the recorder's flush
        atexit.register(close_probes)  # runs before the recorder's own atexit close (LIFO)


def install_classes(rec: Any, classes: list[type]) -> list[Any]:
    """Make and install one probe of each class on recorder `rec` (a process without vLLM's plugin: a
    replay, the driven-scheduler tests); a RuntimeError naming the first that does not attach, after
    the ones before it are uninstalled."""
    probes: list[Any] = []
    for cls in classes:
        probe = cls(rec, rec.options)
        if not probe.install():
            uninstall(probes)
            raise RuntimeError(f"probe {cls.name} did not install: {rec.info['probes'].get(cls.name)}")
        probes.append(probe)
        install([probe])
    return probes


def uninstall(probes: list[Any]) -> None:
    """Flush what `probes` hold (pending steps, decode rows), then restore every target they patched."""
    for probe in reversed(probes):
        if probe in _installed:
            _installed.remove(probe)
        close = getattr(probe, "close", None)
        if close is not None:
            close()
        probe.uninstall()


def installed() -> list[Any]:
    """The probes installed in this process."""
    return list(_installed)


def close_probes() -> None:
    """Let probes flush what they hold (pending steps, device rings); safe to call more than once."""
    _each_probe("close")


def take_pending() -> None:
    """Let probes that hold rows as columns (`take()`) hand them to the recorder now; cheap, on the
    scheduler's thread (the one that appends them), so no row is torn or lost to a race."""
    _each_probe("take")


def _each_probe(method: str) -> None:
    """Call `method()` on every installed probe that has it; a probe's error never reaches the engine."""
    for probe in _installed:
        fn = getattr(probe, method, None)
        if fn is not None:
            try:
                fn()
            except Exception:
                pass


def close_all() -> None:
    """Finish this process's recording now (the engine is shutting down)."""
    close_probes()
    from kvtrace.record.recorder import get_recorder

    rec = get_recorder()
    if rec is not None:
        rec.close()
