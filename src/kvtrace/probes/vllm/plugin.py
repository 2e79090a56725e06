"""vLLM general-plugin entry point: installs kvtrace's probes in every vLLM process.

vLLM calls `register()` once per process (front end, EngineCore, workers) from
`vllm.plugins.load_general_plugins()`. It does nothing unless `KVTRACE_SESSION` names a session
directory (set by `kvtrace record` or `kvtrace.session()`), so having kvtrace installed never changes
an untraced run. Nothing here may raise into vLLM.
"""

from __future__ import annotations

import importlib
import os
import sys

from kvtrace.probes import lifecycle
from kvtrace.probes.vllm import PROBES


def probe_classes(rec=None) -> list[type]:
    """The probe classes of `PROBES`; one whose module does not import is left out, and recorded as
    failed in `rec`'s session when given."""
    classes: list[type] = []
    for module, name in PROBES:
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except Exception as exc:  # an import error is ours to report, never vLLM's
            if rec is not None:
                rec.set_probe_status(module.rsplit(".", 1)[-1], "failed", f"import: {exc!r}"[:300])
    return classes


def register() -> None:
    if lifecycle.installed() or not os.environ.get("KVTRACE_SESSION"):
        return
    rec = None
    try:
        from kvtrace.record.recorder import get_recorder

        rec = get_recorder()
        if rec is None:
            return
        wanted = rec.options.get("probes")  # None = all
        disabled = set(rec.options.get("disable_probes", []))
        installed = []
        for cls in probe_classes(rec):
            if (wanted is not None and cls.name not in wanted) or cls.name in disabled:
                rec.set_probe_status(cls.name, "off", "not requested")
                continue
            probe = cls(rec, rec.options)
            if probe.install():
                installed.append(probe)
        lifecycle.install(installed)
        rec.set_info("probes_installed", True)  # `kvtrace record` prints the verdict once this is set
    except Exception as exc:  # never take vLLM down; the session says so
        print(f"kvtrace: warning: probes not installed: {exc!r}", file=sys.stderr)
        try:
            rec.set_probe_status("plugin", "failed", f"installing the probes: {exc!r}"[:300])
        except Exception:
            pass
