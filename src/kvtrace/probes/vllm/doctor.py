"""What kvtrace will record with the vLLM installed here, without starting an engine (`kvtrace doctor`),
or with another release, from its source (`kvtrace doctor --source`; probes/vllm/source.py reads it):

    python -m kvtrace.probes.vllm.doctor --skeleton WHEEL -o tests/data/vllm_skeletons/X.json
    python -m kvtrace.probes.vllm.doctor --table tests/data/vllm_skeletons/*.json > docs/vllm-support.md

Every probe of `PROBES` checks its hooks against the imported vLLM exactly as it does when it installs
(`Probe.resolve_hooks`), without patching anything. The attention probe's model runners, which it
patches only once a worker imports them, are checked here too (`RUNNER_HOOK`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.probes.base import Hook, Probe, Target, pick_variant
from kvtrace.probes.vllm import PROBES
from kvtrace.probes.vllm.attention import RUNNER, RUNNER_V2, TABLE_KEEPERS
from kvtrace.probes.vllm.source import VllmSource

# The attention probe needs one model runner: V2 (CUDA's default) or V1 (the CPU build's base).
RUNNER_HOOK = Hook("model runner", (
    ((RUNNER_V2, "GPUModelRunner.execute_model", ("scheduler_output",)),),
    ((RUNNER, "GPUModelRunner.execute_model", ("scheduler_output",)),),
))
RUNNER_NAMES = ("V2 (vllm/v1/worker/gpu/model_runner.py)", "V1 (vllm/v1/worker/gpu_model_runner.py)")


def _backend(builder_cls: str) -> str:
    """MLACommonMetadataBuilder -> MLA, FlashInferMetadataBuilder -> FlashInfer."""
    return builder_cls.removesuffix("MetadataBuilder").removesuffix("Common")


# Backends whose metadata has no whole-batch block table: the attention probe reads the batch's tables
# through their builders (patched when a worker loads them). Without one, that backend's KV access is
# reported unsupported; a backend whose module cannot be imported here (FlashInfer without the
# flashinfer package) is not usable either: `unused`.
BUILDER_HOOKS = tuple(
    Hook(f"{_backend(cls)} metadata", (((module, f"{cls}.build", ("common_attn_metadata",)),),), required=False,
         lost=f"KV access with the {_backend(cls)} backends (unsupported)")
    for module, cls in TABLE_KEEPERS.items())


def vllm_version() -> str | None:
    try:
        import vllm

        return str(getattr(vllm, "__version__", None) or "unknown")
    except Exception:
        return None


def probe_hooks() -> list[tuple[str, list[Hook]]]:
    """(probe name, its hooks) for every probe of `PROBES`, the attention probe's model runner included.
    Made without a recorder or vLLM: hooks are the probes' declarations."""
    out = []
    for module, name in PROBES:
        # From the class: hooks are declarations. (Any instance made in this process before a real
        # probe's costs that probe CPython 3.11's inline attribute values, its hot reads.)
        cls: type[Probe] = getattr(importlib.import_module(module), name)
        out.append((cls.name, list(cls.hooks()) + ([RUNNER_HOOK, *BUILDER_HOOKS] if cls.name == "attention" else [])))
    return out


def check(source: str | None = None) -> dict[str, Any]:
    """{"vllm": version or None, "probes": [{"probe", "status", "hooks": [{"hook", "status", "detail"}]}],
    "ok": every probe's required hooks present}: against the imported vLLM, or, with `source` (a wheel,
    a folder holding vllm/, or a skeleton .json), against its source, unimported (probes/vllm/source.py).
    What vLLM prints while it is imported goes to stderr: stdout is the report's."""
    with contextlib.redirect_stdout(sys.stderr):
        if source is not None:
            tree = VllmSource(source)
            return _check(f"{tree.version} (source)", tree.check_targets)
        return _check(vllm_version(), Probe.check_targets)


def _check(version: str | None, check_targets) -> dict[str, Any]:
    report: dict[str, Any] = {"vllm": version, "probes": [], "ok": version is not None}
    if version is None:
        report["error"] = "vLLM is not importable in this Python environment"
        return report
    for name, hooks in probe_hooks():
        entry: dict[str, Any] = {"probe": name, "hooks": []}
        required_missing = False
        for hook in hooks:
            chosen, why = pick_variant(hook, check_targets)
            if chosen is not None and hook is RUNNER_HOOK:  # which runners this vLLM has, V2 first
                variant = ", ".join(name for name, targets in zip(RUNNER_NAMES, hook.variants)
                                    if pick_variant(Hook(hook.name, (targets,)), check_targets)[0] is not None)
                entry["hooks"].append({"hook": hook.name, "status": "attached", "detail": variant})
            elif chosen is not None and not hook.variants[chosen]:  # what the hook handles is not in it
                entry["hooks"].append({"hook": hook.name, "status": "unused", "detail": "not in this release"})
            elif chosen is not None:
                variant = "via " + ", ".join(q for _, q, _ in hook.variants[chosen]) if len(hook.variants) > 1 else ""
                entry["hooks"].append({"hook": hook.name, "status": "attached", "detail": variant})
            elif hook in BUILDER_HOOKS and all(w.startswith("cannot import") and "No module named" in w
                                               and "'vllm" not in w for w in why):
                entry["hooks"].append({"hook": hook.name, "status": "unused",
                                       "detail": f"backend not installed ({'; '.join(why)})"})
            elif hook.required:
                required_missing = True
                entry["hooks"].append({"hook": hook.name, "status": "missing", "detail": "; ".join(why)})
            else:
                entry["hooks"].append({"hook": hook.name, "status": "degraded",
                                       "detail": f"not recorded: {hook.lost} ({'; '.join(why)})"})
        if required_missing:
            entry["status"] = "unsupported"
            report["ok"] = False
        elif any(h["status"] == "degraded" for h in entry["hooks"]):
            entry["status"] = "degraded"
        else:
            entry["status"] = "attached"
        report["probes"].append(entry)
    return report


def verdict_line(report: dict[str, Any]) -> str:
    """One line: the vLLM version and each probe's status."""
    if report["vllm"] is None:
        return f"kvtrace doctor: {report.get('error')}"
    parts = ", ".join(f"{p['probe']} {p.get('status')}" for p in report["probes"])
    return f"vLLM {report['vllm']}: {parts}"


# ---- releases' source: skeletons and the support table ----------------------------------------------
def all_targets() -> list[Target]:
    """Every target of every variant of every hook of the vLLM probes (and the attention probe's runners)."""
    return [t for _name, hooks in probe_hooks() for hook in hooks for variant in hook.variants for t in variant]


def table(paths: list[str]) -> str:
    """docs/vllm-support.md: per vLLM release (skeletons, oldest first), each probe and hook's status."""
    reports = sorted((check(source=p) for p in paths), key=lambda r: _version_key(r["vllm"]))
    versions = [r["vllm"].removesuffix(" (source)") for r in reports]
    out = ["# vLLM support", "",
           "Generated by `python -m kvtrace.probes.vllm.doctor --table tests/data/vllm_skeletons/*.json` "
           "(`make support-doc`) from each release's source, as `kvtrace doctor --source` reads it; do not "
           "edit. `attached` names the variant a hook takes where there are several; `degraded` says what "
           "is not recorded; `missing` disables the probe; `unused: not in this release` marks a hook for "
           "something the release does not do. Runtime behaviour that changed between "
           "releases is not in this table: see docs/architecture.md and the issues.", "",
           "| probe | hook | " + " | ".join(versions) + " |", "|---|---|" + "---|" * len(versions)]
    rows: dict[tuple[str, str], list[str]] = {}
    for i, report in enumerate(reports):
        for probe in report["probes"]:
            for hook in probe["hooks"]:
                cell = hook["status"] + (f": {hook['detail']}" if hook["detail"] else "")
                rows.setdefault((probe["probe"], hook["hook"]), [""] * len(reports))[i] = cell.replace("|", "/")
    for (probe, hook), cells in rows.items():
        out.append(f"| {probe} | {hook} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _version_key(version: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+]", version.split(" ")[0])[:3])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skeleton", help="a vLLM wheel or source folder to make a skeleton of")
    ap.add_argument("-o", "--output", help="where to write the skeleton (default: stdout)")
    ap.add_argument("--table", nargs="+", help="skeletons (or wheels, folders) to make the support table of")
    args = ap.parse_args(argv)
    try:
        if args.skeleton:
            text = json.dumps(VllmSource(args.skeleton).skeleton(all_targets()), indent=1, sort_keys=True) + "\n"
            if args.output:
                Path(args.output).write_text(text)
            else:
                sys.stdout.write(text)
        elif args.table:
            sys.stdout.write(table(args.table))
        else:
            ap.error("give --skeleton or --table")
    except KvtraceError as exc:
        sys.exit(f"kvtrace: error: {exc}")


if __name__ == "__main__":
    main()
