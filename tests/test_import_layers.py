"""The package's modules import one another without circles (docs/architecture.md draws the layers).

Every ``from coldset... import`` counts, lazy ones inside functions included: a lazy import still
ties the two modules' concepts together, and a circle of them is where "one way to do each
thing" breaks first.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "coldset"


def import_graph() -> dict[str, set[str]]:
    mods: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ("coldset." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("coldset"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)  # `from coldset import x` names a module
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("coldset"))
        mods[name] = deps
    return {m: {d for d in deps if d in mods and d not in (m, "coldset")} for m, deps in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# The packages from the bottom up (docs/architecture.md "Layers"): a module imports only from its
# own package and the packages before it.
PACKAGE_ORDER = ("core", "kernels", "analysis", "engine", "trace", "verify", "bench", "reporting", "serve",
                 "workflow", "measure", "cli", "__main__")


def package_of(module: str) -> str:
    return module.split(".")[1]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    rank = {p: i for i, p in enumerate(PACKAGE_ORDER)}
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if rank[package_of(d)] > rank[package_of(m)])


def test_every_module_belongs_to_a_layer():
    assert {package_of(m) for m in import_graph() if m != "coldset"} <= set(PACKAGE_ORDER)


def test_packages_import_downwards_only():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_finds_a_planted_upward_import():
    graph = {"coldset.core.files": {"coldset.engine.model"}, "coldset.engine.model": {"coldset.core.files"}}
    assert upward_imports(graph) == [("coldset.core.files", "coldset.engine.model")]


def test_the_trace_format_sits_below_its_readers():
    """core.trace depends on none of the modules that read or write traces."""
    graph = import_graph()
    readers = {"coldset.trace.capture", "coldset.trace.importers", "coldset.trace.fixtures",
               "coldset.analysis.streams", "coldset.analysis.stats"}  # forecast reads traces through streams
    assert not graph["coldset.core.trace"] & readers
    assert all("coldset.core.trace" in graph[m] for m in readers)
    assert "coldset.workflow.sweep" not in graph["coldset.workflow.pipeline"]
    assert "coldset.workflow.pipeline" in graph["coldset.workflow.sweep"]
