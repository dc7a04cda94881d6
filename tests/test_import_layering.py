"""The import layering of the source packages, read with ``ast`` (function-local imports too).

Allowed directions (DESIGN.md, "Layout"), an arrow meaning "may import":

=====================  ==============================================================
module                 may import (besides the standard library and third parties)
=====================  ==============================================================
planner vocabulary     planner vocabulary only
(every planner module
not listed below)
cost_model.*           planner vocabulary, cost_model
(and a family's
``costs.py``)
search.*               planner vocabulary, cost_model, search
(and a family's
``candidates.py``)
codegen.*              planner vocabulary, codegen (never search, never cost_model)
(and a family's
``emit.py``,
``runtime.py``)
planner API            anything: ``planner.api``, ``planner.cli`` (its grammar: ``planner.cli_parser``), ``planner.__main__``,
                       ``planner.compare`` (``compare``/``calibrate``, over the cost
                       model's calibration) and ``planner.baselines`` (Megatron's and
                       the data-parallel layouts, built by search) and
                       ``planner.colocation`` (``planner colocate``: plans and
                       simulates each job, schedules them with the cost model)
=====================  ==============================================================

Besides the layers: no circle among the modules (a strongly connected set of modules that
import each other, directly or through others, a function-local import included: a local
import hides a circle, it does not remove it), and no module imports another module's
``_private`` name (a name one module shares with others is public: name it so).
``from planner import name`` counts as an import of the module the package's lazy
attribute resolves to (``planner/__init__.py``'s ``_LAZY``). Imports under ``if
TYPE_CHECKING:`` are left out: they name types for annotations and never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "cost_model", "search", "codegen")
PLANNER_API = frozenset({
    "planner.api", "planner.cli", "planner.cli_parser", "planner.__main__", "planner.compare", "planner.baselines", "planner.colocation",
})
ALLOWED = {  # layer -> the layers it may import
    "vocabulary": {"vocabulary"},
    "cost_model": {"vocabulary", "cost_model"},
    "search": {"vocabulary", "cost_model", "search"},
    "codegen": {"vocabulary", "codegen"},
    "api": {"vocabulary", "cost_model", "search", "codegen", "api"},
}


def source_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = source_modules()


# A family's own folder (planner/families/<folder>/) holds its parts, each in the file its
# layer names (planner.families): those files are held to that layer.
FAMILY_PART_LAYERS = {"candidates": "search", "costs": "cost_model", "emit": "codegen", "runtime": "codegen"}


def layer(module: str) -> str:
    if module in PLANNER_API:
        return "api"
    parts = module.split(".")
    if parts[:2] == ["planner", "families"] and len(parts) == 4 and parts[3] in FAMILY_PART_LAYERS:
        return FAMILY_PART_LAYERS[parts[3]]
    package = module.split(".")[0]
    return "vocabulary" if package == "planner" else package


def lazy_planner_names() -> dict[str, str]:
    """``planner/__init__.py``'s ``_LAZY`` table, read from its source (importing it is what
    the table avoids)."""
    tree = ast.parse((ROOT / "planner" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("planner/__init__.py has no _LAZY table")


LAZY = lazy_planner_names()


def owning_module(dotted: str) -> str | None:
    """The source module ``dotted`` names (a module, or a name inside one), or None."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def statements_that_run(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        pending.extend(child for child in ast.iter_child_nodes(node) if not is_type_checking_block(child))


def imports_of(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every import in ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in statements_that_run(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = owning_module(alias.name)
                if target:
                    found.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:  # a submodule
                    found.append((f"{base}.{alias.name}", "", node.lineno))
                elif base == "planner" and alias.name in LAZY:
                    found.append((LAZY[alias.name], alias.name, node.lineno))
                elif owning_module(base):
                    found.append((owning_module(base), alias.name, node.lineno))
    return found


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module in MODULES:
        for target, _, _ in imports_of(module):
            if target != module:
                graph.add_edge(module, target)
    return graph


def test_no_import_circles():
    circles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not circles, "import circles (function-local imports included): " + "; ".join(
        " <-> ".join(circle) for circle in circles
    )


def test_imports_follow_the_layers():
    wrong = [
        f"{module}:{line} imports {target} ({layer(module)} may import {sorted(ALLOWED[layer(module)])})"
        for module in MODULES
        for target, _, line in imports_of(module)
        if layer(target) not in ALLOWED[layer(module)]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_another_modules_private_names():
    wrong = [
        f"{module}:{line} imports {name} from {target}"
        for module in MODULES
        for target, name, line in imports_of(module)
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not wrong, "\n".join(wrong)


def test_the_reader_sees_what_the_tests_rely_on():
    """The checks above are only as good as the reader: it must see a function-local import,
    a relative import and a lazy ``planner`` attribute, and the layers must be real."""
    tree_modules = {layer(m) for m in MODULES}
    assert tree_modules == set(ALLOWED)
    local = [t for t, _, line in imports_of("codegen.attention_core") if t == "codegen.graph_facts"]
    assert local, "codegen.attention_core imports codegen.graph_facts inside a function"
    assert ("planner.api", "plan", 1) not in imports_of("planner.cli")  # sanity: line numbers are real
    assert any(t == "planner.errors" for t, _, _ in imports_of("planner.api"))
    assert LAZY["plan"] == "planner.api"
    # planner.report names Plan only for annotations; planner.plans imports the report at call time.
    assert not any(t == "planner.plans" for t, _, _ in imports_of("planner.report"))
    assert any(t == "planner.report" for t, _, _ in imports_of("planner.plans"))
    # A circle is found when there is one (the graph, not a special case).
    graph = import_graph()
    graph.add_edge("planner.errors", "planner.api")
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))


def test_family_parts_live_in_their_layers():
    """Each part a family declares (``planner.families``) names a function of a module of the
    part's layer: the search resolves candidates, the simulator costs, the compiler emitters
    and the report its sections, each without importing above itself."""
    from planner.families import PART_LAYERS, registered, resolve

    wrong = []
    for family in registered():
        for role, wanted in PART_LAYERS.items():
            reference = getattr(family, role)
            if not reference:
                continue
            module = reference.partition(":")[0]
            if module not in MODULES:
                wrong.append(f"{family.name}.{role} = {reference!r}: no module {module}")
            elif layer(module) != wanted:
                wrong.append(f"{family.name}.{role} = {reference!r} is in the {layer(module)} layer, not {wanted}")
            else:
                assert callable(resolve(reference)), reference
    assert not wrong, "\n".join(wrong)
