"""The package's layout: folder = import name, imports follow the data flow (no cycle, no folder importing
one above it), and what a built wheel holds is what the source tree holds.

The layers, lowest first (docs/architecture.md): errors and version; format (the on-disk contract);
record (the in-process recorder); probes; store (the DuckDB layout); ingest; queries; export; testing;
demo; replay (runs the scheduler with the probes, on the demo's tiny model); then the command line and the package's own API on top. A module may import its own folder and
the folders below it, at module level or inside a function alike.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
LAYERS = [("errors", "version"), ("format",), ("record",), ("probes",), ("store",), ("ingest",), ("queries",),
          ("export",), ("testing",), ("demo",), ("replay",), ("cli", "__main__", "")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    """Every module of the package by its import name (a package by its __init__.py)."""
    out = {}
    for path in sorted((SRC / "kvtrace").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The kvtrace modules `path` imports, anywhere in it (a name imported from a package that is a
    module of its own counts as that module)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kvtrace"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kvtrace":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imports_of(path, name, set(mods)) if m in mods} for name, path in mods.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_folder_is_a_known_layer():
    assert {layer(m) for m in modules()} <= set(RANK), "a new top-level folder: add it to LAYERS and docs"


def test_the_import_graph_has_no_cycle():
    assert cycles(graph()) == []


def test_imports_go_down_the_layers():
    wrong = [f"{m} imports {d}" for m, deps in sorted(graph().items()) for d in sorted(deps)
             if RANK[layer(d)] > RANK[layer(m)]]
    assert wrong == []


def test_a_cycle_and_an_upward_import_would_be_seen():
    """The checks above find what they look for (a made-up graph)."""
    g = {"kvtrace.format.a": {"kvtrace.record.b"}, "kvtrace.record.b": {"kvtrace.format.a"}}
    assert cycles(g) == [["kvtrace.format.a", "kvtrace.record.b"]]
    assert RANK[layer("kvtrace.record.b")] > RANK[layer("kvtrace.format.a")]


def test_pyproject_maps_no_folder_and_names_real_entry_points():
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "package-dir" not in doc["tool"]["setuptools"]
    mods = modules()
    targets = [doc["project"]["scripts"]["kvtrace"],
               *doc["project"]["entry-points"]["vllm.general_plugins"].values()]
    for target in targets:
        module, _, attr = target.partition(":")
        assert module in mods, target
        assert f"def {attr}(" in mods[module].read_text(), target
    for ext in doc["tool"]["setuptools"]["ext-modules"]:
        (source,) = ext["sources"]
        assert (REPO / source).is_file() and ext["name"] == ".".join(Path(source).relative_to("src").with_suffix("").parts)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out), str(REPO)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    (whl,) = out.glob("kvtrace-*.whl")
    return whl


def test_the_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"kvtrace", next(t for t in tops if t.endswith(".dist-info"))}, tops  # nothing else in site-packages
    src_files = {str(p.relative_to(SRC)) for p in (SRC / "kvtrace").rglob("*")
                 if p.is_file() and p.suffix in (".py", ".sql", ".cu", ".html", ".js", ".css")}
    assert src_files - names == set()
    assert any(n.startswith("kvtrace/record/_columns.") and n.endswith(".so") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvtrace.probes.vllm.plugin:register" in zipfile.ZipFile(wheel).read(entry).decode()


def test_the_installed_wheel_runs(wheel, tmp_path):
    """Unpacked (what pip installs), it imports ahead of the editable checkout and runs `python -m kvtrace`."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import kvtrace, kvtrace.record.buffers as b, kvtrace.queries as q; "
            "print(kvtrace.__file__); print(b.native()); print(len(q.all_queries()))")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    where, native, queries = proc.stdout.split()
    assert where.startswith(str(site)) and native == "True" and int(queries) > 10
    proc = subprocess.run([sys.executable, "-m", "kvtrace", "query", "--list"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "summary" in proc.stdout, proc.stderr
