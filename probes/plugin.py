"""vLLM general-plugin entry point: installs kvtrace's probes in every vLLM process.

vLLM calls `register()` once per process (front end, EngineCore, workers) from
`vllm.plugins.load_general_plugins()`. It does nothing unless `KVTRACE_SESSION` names a session
directory (set by `kvtrace record` or `kvtrace.session()`), so having kvtrace installed never changes
an untraced run. Nothing here may raise into vLLM.
"""

from __future__ import annotations

import atexit
import os
import sys

_installed: list = []


def probe_classes() -> list[type]:
    from kvtrace.probes.kv_blocks import BlockPoolProbe, PrefixCacheProbe
    from kvtrace.probes.scheduler import SchedulerProbe

    classes: list[type] = [SchedulerProbe, BlockPoolProbe, PrefixCacheProbe]
    for module, cls in (("kvtrace.probes.connector", "ConnectorProbe"),
                        ("kvtrace.probes.attention", "AttentionProbe"),
                        ("kvtrace.probes.engine_stop", "EngineStopProbe")):
        try:
            classes.append(getattr(__import__(module, fromlist=[cls]), cls))
        except (ImportError, AttributeError):
            pass
    return classes


def register() -> None:
    if _installed or not os.environ.get("KVTRACE_SESSION"):
        return
    try:
        from kvtrace.recorder import get_recorder

        rec = get_recorder()
        if rec is None:
            return
        wanted = rec.options.get("probes")  # None = all
        disabled = set(rec.options.get("disable_probes", []))
        for cls in probe_classes():
            if (wanted is not None and cls.name not in wanted) or cls.name in disabled:
                rec.set_probe_status(cls.name, "off", "not requested")
                continue
            probe = cls(rec, rec.options)
            if probe.install():
                _installed.append(probe)
        atexit.register(close_probes)  # runs before the recorder's own atexit close (LIFO)
    except Exception as exc:  # never take vLLM down
        print(f"kvtrace: warning: probes not installed: {exc!r}", file=sys.stderr)


def close_probes() -> None:
    """Let probes flush what they hold (pending steps, device rings); safe to call more than once."""
    _each_probe("close")


def take_pending() -> None:
    """Let probes that hold rows as columns (`take()`) hand them to the recorder now; cheap, on the
    scheduler's thread (the one that appends them), so no row is torn or lost to a race."""
    _each_probe("take")


def _each_probe(method: str) -> None:
    """Call `method()` on every installed probe that has it; a probe's error never reaches vLLM."""
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
    from kvtrace.recorder import get_recorder

    rec = get_recorder()
    if rec is not None:
        rec.close()
