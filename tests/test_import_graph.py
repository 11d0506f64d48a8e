"""The import graph of replica/, router/, cluster/ and sim/ (docs/import_graph.py, read from the
sources with ast, function-level and type-only imports included): no import cycle between
modules, the router uses the replica package only through replica.api and replica.config, and
docs/architecture.md shows the current package graph."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUTER_MAY_IMPORT = {"replica.api", "replica.config"}


@functools.cache
def _import_graph():
    """docs/import_graph.py (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def router_violations(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Router module -> the replica modules it imports beyond replica.api and replica.config."""
    out = {}
    for module, targets in graph.items():
        if module.split(".")[0] != "router":
            continue
        bad = {t for t in targets if t.split(".")[0] == "replica"} - ROUTER_MAY_IMPORT
        if bad:
            out[module] = bad
    return out


def test_no_import_cycle_between_modules():
    ig = _import_graph()
    found = ig.cycles(ig.module_graph())
    assert found == []


def test_cycles_are_found_through_function_level_and_type_only_imports(tmp_path):
    for package in ("replica", "router", "cluster", "sim"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "replica" / "a.py").write_text("def f():\n    from replica.b import g\n")
    (tmp_path / "replica" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from replica import a\n"
    )
    (tmp_path / "router" / "x.py").write_text("from replica.a import f\nfrom . import y\n")
    (tmp_path / "router" / "y.py").write_text("import router.x\n")
    ig = _import_graph()
    graph = ig.module_graph(tmp_path)
    assert graph["replica.a"] == {"replica.b"} and graph["replica.b"] == {"replica.a"}
    assert ig.cycles(graph) == [["replica.a", "replica.b"], ["router.x", "router.y"]]
    assert router_violations(graph) == {"router.x": {"replica.a"}}
    assert ig.module_graph(tmp_path, lazy=False)["replica.a"] == set()


def test_router_imports_from_replica_only_its_api_and_config():
    violations = router_violations(_import_graph().module_graph())
    unexpected = {m: sorted(v) for m, v in violations.items()}
    assert unexpected == {}, "import these through replica.api (add names there if needed)"


def test_architecture_doc_shows_the_current_package_graph():
    ig = _import_graph()
    doc = ig.DOC.read_text()
    assert ig.render(doc) == doc, "docs/architecture.md is stale: run python docs/import_graph.py"
