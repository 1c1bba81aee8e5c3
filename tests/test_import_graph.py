"""The import graph points one way, floor by floor, with no circle; no test module imports another.

Every module's imports are read with `ast` (module level, inside functions and under `TYPE_CHECKING`
alike: a deferred import is still a dependency) and each module is put on its floor by `FLOORS`, the
longest dotted prefix that names it:

- base: the modules directly inside `kmesh_trace/` (the schema, values, errors, paths, the trace
  writer and reader, the inputs: `sources`), the importers (`datasets/importers/`), the capture
  (`capture/`), the corpus and capture audits (`audit/`) and the C boundary (`native/`);
- model: what the analyses replay: the access stream, the workload, families, the pool models, the
  policies and their curves, the tier kernels, the cost models, the executor, the workload generators
  (`datasets/workloads/`);
- analyses: headroom (and its curves), pressure, tiers, fleet, lineage, residency, model error;
- applications: `kmesh_trace.apps` (report, advise, plots, export, the demo);
- cli: `kmesh_trace.cli`.

A module imports only modules of its floor or a lower one. The source folders come from pyproject.toml's
`package-dir`, so a new package is read without editing this file; a module no row of `FLOORS` names fails
`test_every_package_has_a_layer`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
BASE, MODEL, ANALYSES, APPLICATIONS, CLI = range(5)
LAYER_NAMES = {BASE: "base", MODEL: "model", ANALYSES: "analyses", APPLICATIONS: "applications", CLI: "cli"}
#: Dotted prefix -> floor; the longest prefix naming a module wins. The base modules directly inside
#: `kmesh_trace/` are the `kmesh_trace` row (a subpackage needs a row of its own).
FLOORS = {
    "kmesh_trace": BASE,
    "kmesh_trace.audit": BASE,
    "kmesh_trace.capture": BASE,
    "kmesh_trace.datasets": MODEL,
    "kmesh_trace.datasets.importers": BASE,
    "kmesh_trace.datasets.workloads": MODEL,
    "kmesh_trace.native": BASE,
    "kmesh_trace.oracle": MODEL,
    "kmesh_trace.oracle.fleet": ANALYSES,
    "kmesh_trace.oracle.headroom": ANALYSES,
    "kmesh_trace.oracle.headroom_curve": ANALYSES,
    "kmesh_trace.oracle.lineage_report": ANALYSES,
    "kmesh_trace.oracle.model_error": ANALYSES,
    "kmesh_trace.oracle.pressure": ANALYSES,
    "kmesh_trace.oracle.residency": ANALYSES,
    "kmesh_trace.oracle.sampled_curve": ANALYSES,
    "kmesh_trace.oracle.shards": ANALYSES,
    "kmesh_trace.oracle.streamed_curve": ANALYSES,
    "kmesh_trace.oracle.tiers": ANALYSES,  # the package: `run`, its report and the family-burst arms
    "kmesh_trace.oracle.tiers.compiled": MODEL,
    "kmesh_trace.oracle.tiers.config": MODEL,
    "kmesh_trace.oracle.tiers.connector": MODEL,
    "kmesh_trace.oracle.tiers.prep": MODEL,
    "kmesh_trace.oracle.tiers.replay": MODEL,
    "kmesh_trace.oracle.tiers.result": MODEL,
    "kmesh_trace.oracle.tiers.simulate": MODEL,
    "kmesh_trace.oracle.tiers.store": MODEL,
    "kmesh_trace.oracle.tiers.sweep": MODEL,
    "kmesh_trace.oracle.tiers.timing": MODEL,
    "kmesh_trace.apps": APPLICATIONS,
    "kmesh_trace.cli": CLI,
}
#: Subpackages whose modules the base prefix `kmesh_trace` must not claim (each has its own row).
SUBPACKAGES = ("kmesh_trace.apps", "kmesh_trace.audit", "kmesh_trace.capture", "kmesh_trace.cli",
               "kmesh_trace.datasets", "kmesh_trace.native", "kmesh_trace.oracle")


def package_dirs() -> dict[str, Path]:
    """Installed package name -> its source folder, as pyproject.toml declares them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = config["package-dir"]
    found = {}
    for package in config["packages"]:
        # The nearest declared ancestor gives the folder: kmesh_trace.oracle.policies -> oracle/policies.
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in declared:
                found[package] = ROOT / declared[head] / Path(*parts[cut:])
                break
    return found


def source_modules() -> dict[str, Path]:
    """Every module of the installed packages: dotted name -> file (a package's name -> its __init__)."""
    modules = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def imported_names(path: Path, module: str) -> list[tuple[str, int]]:
    """Every absolute module name `path` imports anywhere in its body, with the line it is on."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import name` may name a submodule: keep both, resolution picks the module.
            names.append((base, node.lineno))
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return names


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` lands in (the longest known prefix), or None for a third-party one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in modules:
            return head
    return None


def layer(module: str) -> int | None:
    """The floor of a project module: the `FLOORS` row of its longest dotted prefix (None: no row names it)."""
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in FLOORS:
            if head == "kmesh_trace" and module != "kmesh_trace" and (module.count(".") > 1 or module in SUBPACKAGES):
                return None  # a subpackage of kmesh_trace with no row of its own
            return FLOORS[head]
    return None


def import_edges() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import between two project modules."""
    modules = source_modules()
    edges = set()
    for module, path in modules.items():
        for name, line in imported_names(path, module):
            target = resolve(name, modules)
            if target is not None and target != module:
                edges.add((module, target, line))
    return sorted(edges)


def upward_imports() -> list[str]:
    return [f"{LAYER_NAMES[layer(a)]} {a} (line {line}) imports {LAYER_NAMES[layer(b)]} {b}"
            for a, b, line in import_edges() if layer(b) > layer(a)]


def test_the_graph_is_read():
    """The reader finds what it must, so an empty graph cannot pass the layering test by accident."""
    modules = source_modules()
    assert {"kmesh_trace.schema", "kmesh_trace.oracle.blockpool", "kmesh_trace.cli", "kmesh_trace.apps.report"} <= set(modules)
    edges = {(a, b) for a, b, _ in import_edges()}
    assert ("kmesh_trace.oracle.blockpool", "kmesh_trace.holds") in edges
    # A function-level import counts: capture's plugin hook imports its wrappers only when vLLM calls it.
    deferred = [(a, b) for a, b in edges if a == "kmesh_trace.capture.plugin"]
    assert deferred, "the function-level imports of kmesh_trace.capture.plugin were not read"


def test_every_package_has_a_layer():
    unplaced = sorted(m for m in source_modules() if layer(m) is None)
    assert not unplaced, f"modules in no layer (add their package to a layer in this test): {unplaced}"


def test_imports_point_one_way():
    """base <- model <- analyses <- applications <- cli: no module imports one of a higher floor, deferred or not."""
    upward = upward_imports()
    assert not upward, f"{len(upward)} upward import(s):\n" + "\n".join(upward)


def test_the_jsonl_classifier_is_a_leaf_both_audit_and_importers_use():
    edges = {(a, b) for a, b, _ in import_edges()}
    assert not [b for a, b in edges if a == "kmesh_trace.jsonl_lines"]
    assert {("kmesh_trace.audit.corpus", "kmesh_trace.jsonl_lines"),
            ("kmesh_trace.datasets.importers.common", "kmesh_trace.jsonl_lines")} <= edges
    # The importers of plain JSONL formats no longer reach into the audit for it.
    assert not [b for a, b in edges if a in ("kmesh_trace.datasets.importers.common", "kmesh_trace.datasets.importers.mooncake")
                and b.startswith("kmesh_trace.audit")]


def test_the_check_catches_an_upward_import(tmp_path):
    """The classification would flag a base module importing the model, the model an analysis, and so on."""
    assert layer("kmesh_trace.schema") == BASE
    assert layer("kmesh_trace.datasets.importers.mooncake") == BASE
    assert layer("kmesh_trace.oracle.stream") == MODEL
    assert layer("kmesh_trace.oracle.tiers.compiled") == MODEL
    assert layer("kmesh_trace.oracle.pressure") == ANALYSES
    assert layer("kmesh_trace.oracle.tiers.run") == ANALYSES
    assert layer("kmesh_trace.apps.report") == APPLICATIONS
    assert layer("kmesh_trace.cli.tiers") == CLI
    assert layer("kmesh_trace.newpackage.module") is None  # a new subpackage needs its row
    module = tmp_path / "fake.py"
    module.write_text("def f():\n    from kmesh_trace.oracle.stream import request_blocks\n")
    assert imported_names(module, "kmesh_trace.fake")[0] == ("kmesh_trace.oracle.stream", 2)


def test_no_test_module_imports_another():
    """Shared test helpers live in helper modules (tests/*.py not named test_*), never in a test module."""
    tests = ROOT / "tests"
    test_modules = {p.stem for p in tests.glob("test_*.py")}
    offending = []
    for path in sorted(tests.glob("test_*.py")):
        for name, line in imported_names(path, f"tests.{path.stem}"):
            top = name.removeprefix("tests.").split(".")[0]
            if top in test_modules and top != path.stem:
                offending.append(f"{path.name}:{line} imports {top}")
    assert not offending, "test modules importing test modules:\n" + "\n".join(sorted(set(offending)))


def import_circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in import_edges():
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles = []

    def visit(root: str) -> None:
        # Iterative, so a deep graph cannot exhaust Python's recursion limit.
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles, key=lambda c: (-len(c), c))


def test_the_circle_finder_finds_a_circle():
    graph_edges = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]
    global import_edges
    real = import_edges
    try:
        import_edges = lambda: [(a, b, 1) for a, b in graph_edges]  # noqa: E731
        assert import_circles() == [["a", "b", "c"]]
    finally:
        import_edges = real


def test_no_import_circle():
    """No two project modules reach each other, counting imports made inside functions."""
    edges = import_edges()
    lines = []
    for circle in import_circles():
        members = set(circle)
        lines.append(f"{len(circle)} modules: " + ", ".join(circle))
        lines += [f"    {a} (line {line}) -> {b}" for a, b, line in edges if a in members and b in members]
    assert not lines, f"{len(import_circles())} import circle(s):\n" + "\n".join(lines)
