"""vLLM's hooks checked against its source, without importing it: a release that will not import here
(another torch, no CPU build, 0.33's) can still be asked what kvtrace would record with it.

    python -m kvtrace.probes.vllm.doctor --skeleton vllm-0.33.0-...whl -o tests/data/vllm_skeletons/0.33.0.json
    python -m kvtrace.probes.vllm.doctor --table tests/data/vllm_skeletons/*.json > docs/vllm-support.md
    kvtrace doctor --source vllm-0.33.0-...whl      (or a folder holding vllm/, or a skeleton .json)

A skeleton is what the checks read of a release, kept small: for each module a hook names, the names the
hooks look up there (with the classes on their path) and their parameter names, methods a class inherits
and names a module imports from elsewhere in vLLM resolved.
"""

from __future__ import annotations

import ast
import json
import re
import zipfile
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.probes.base import Target, TargetMissing

MAX_SOURCE_BYTES = 8 << 20  # a module bigger than this is not vLLM's


class VllmSource:
    """The parameter names of vLLM's classes and functions, by module, read from a wheel, a folder
    holding `vllm/`, or a skeleton file (`skeleton()`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._read = None
        self.version = "unknown"
        self.modules: dict[str, dict[str, list[str] | None]] = {}  # module -> qualname -> params
        if self.path.is_file() and self.path.suffix == ".json":
            try:
                doc = json.loads(self.path.read_text())
                self.version, self.modules = str(doc["vllm"]), dict(doc["modules"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise KvtraceError(f"{self.path}: not a vLLM skeleton ({exc})") from None
        elif self.path.is_file() and self.path.suffix == ".whl":
            try:
                wheel = zipfile.ZipFile(self.path)
            except (OSError, zipfile.BadZipFile) as exc:
                raise KvtraceError(f"{self.path}: not a wheel ({exc})") from None
            names = set(wheel.namelist())
            self._read = lambda name: (wheel.read(name) if name in names and
                                       wheel.getinfo(name).file_size <= MAX_SOURCE_BYTES else None)
            meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
            match = re.search(rb"^Version: (\S+)", wheel.read(meta), re.M) if meta else None
            self.version = match.group(1).decode() if match else "unknown"
        elif (self.path / "vllm").is_dir():
            root = self.path

            def read(name: str) -> bytes | None:
                f = root / name
                return f.read_bytes() if f.is_file() and f.stat().st_size <= MAX_SOURCE_BYTES else None

            self._read = read
            text = read("vllm/_version.py") or b""
            match = re.search(rb"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)""", text)
            self.version = match.group(1).decode() if match else "unknown"
        else:
            raise KvtraceError(f"{self.path}: not a vLLM wheel, a folder holding vllm/, or a skeleton .json")

    # ---- reading the source -------------------------------------------------------------------------
    def _parse(self, module: str) -> ast.Module | None:
        if self._read is None:
            return None
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            data = self._read(name)
            if data is not None:
                try:
                    return ast.parse(data, name)
                except (SyntaxError, ValueError):
                    return None
        return None

    def _load(self, module: str, depth: int = 0) -> dict[str, list[str] | None] | None:
        """qualname -> parameter names (None: not a function) for `module`, inherited methods included."""
        if module in self.modules or self._read is None:
            return self.modules.get(module)
        tree = self._parse(module)
        if tree is None:
            return None
        imported: dict[str, str] = {}  # name -> module it comes from
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    imported[alias.asname or alias.name] = node.module
        out: dict[str, list[str] | None] = {}
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.modules[module] = out  # before the bases are read: a cycle of imports ends here
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = _params(node.args)
            elif isinstance(node, ast.ClassDef):
                out[node.name] = None
                self._methods(node, node.name, out, classes, imported, module, depth)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out.setdefault(target.id, None)
        # Names imported into the module (`from vllm.v1.utils import shutdown`): a target may name them
        # here, as the imported module's attribute does.
        for name, origin in imported.items():
            if name not in out and origin.split(".")[0] == "vllm" and depth < 8:
                other = self._load(origin, depth + 1) or {}
                for qual, params in other.items():
                    if qual == name or qual.startswith(f"{name}."):
                        out.setdefault(qual, params)
        return out

    def _methods(self, cls: ast.ClassDef, prefix: str, out: dict, classes: dict, imported: dict, module: str,
                 depth: int) -> None:
        """`cls`'s methods as `prefix.name` into `out`, then those it inherits that `out` lacks (a class's
        own methods win over its bases')."""
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(f"{prefix}.{item.name}", _params(item.args))
        if depth > 8:
            return
        for base in cls.bases:  # inherited methods, from bases in this module or imported by name
            name = base.id if isinstance(base, ast.Name) else None
            if name is None:
                continue
            if name in classes and classes[name] is not cls:
                self._methods(classes[name], prefix, out, classes, imported, module, depth + 1)
            elif name in imported:
                other = self._load(imported[name], depth + 1) or {}
                for qual, params in other.items():
                    if qual.startswith(f"{name}."):
                        out.setdefault(f"{prefix}.{qual[len(name) + 1:]}", params)

    # ---- the checks ---------------------------------------------------------------------------------
    def check_targets(self, targets: Any) -> None:
        """TargetMissing unless every (module, qualname, parameter names) target exists as named: the
        same answer `Probe.check_targets` gives on the imported release."""
        for module, qualname, params in targets:
            found = self._load(module)
            if found is None:
                raise TargetMissing(f"cannot import {module}: not in the source")
            if qualname not in found:
                parts = qualname.split(".")
                missing = next((p for i, p in enumerate(parts) if ".".join(parts[: i + 1]) not in found), parts[-1])
                raise TargetMissing(f"{module}.{qualname} not found (no attribute {missing!r})")
            names = found[qualname]
            if params and names is not None and not {"*args", "**kwargs"} & set(names):
                gone = [p for p in params if p not in names]
                if gone:
                    raise TargetMissing(f"{module}.{qualname}: signature changed, missing parameter(s) "
                                        f"{', '.join(gone)}")

    def skeleton(self, targets: list[Target]) -> dict[str, Any]:
        """{"vllm": version, "modules": {module: {qualname: params}}}: of each module `targets` name, the
        names they look up (each target's qualname and the classes on its path), where present."""
        wanted: dict[str, set[str]] = {}
        for module, qualname, _params in targets:
            parts = qualname.split(".")
            wanted.setdefault(module, set()).update(".".join(parts[: i + 1]) for i in range(len(parts)))
        out = {}
        for module in sorted(wanted):
            found = self._load(module)
            if found is not None:
                out[module] = {q: found[q] for q in sorted(wanted[module]) if q in found}
        return {"vllm": self.version, "modules": out}


def _params(args: ast.arguments) -> list[str]:
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if args.vararg:
        names.append("*args")
    if args.kwarg:
        names.append("**kwargs")
    return names
