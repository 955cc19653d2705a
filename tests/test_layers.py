"""Imports run one way: a module imports only from its own layer or the layers below it, and
no group of modules imports itself round in a circle.

The layer order is written once, here (lowest first). A module that needs something from a
layer above takes it as a parameter typed by a small Protocol. Every import counts: at module
level, inside a function (a lazy import is still a dependency) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "kvtier.errors",
        "kvtier.lifecycle",
        "kvtier.framing",
        "kvtier.host_memory",
        "kvtier.trust",  # who may connect: one handshake and one set of bounds for every port
        "kvtier.repeated_log",
        "kvtier.local_sockets",
        "kvtier.cpu_affinity",
    ),
    (
        "kvtier.config",
        "kvtier.kv_groups",
        "kvtier.layout",
        "kvtier.tokens",
        "kvtier.fingerprint",
        "kvtier.request_salt",
        "kvtier.keys",
        "kvtier.validation",
        "kvtier.hit",  # a lookup's answer: the engine's, the server's wire's, the vLLM channel's
        "kvtier.cache",
    ),
    ("kvtier.memory",),
    ("kvtier.lease",),
    ("kvtier.storage",),
    ("kvtier.pd",),
    ("kvtier.p2p",),  # peers' kvtier servers: pd's handshake and checksum, a storage tier
    ("kvtier.tiers",),  # builds the lower tiers of both storage and pd
    ("kvtier.observability",),
    ("kvtier.engine",),
    ("kvtier.admin",),
    ("kvtier.service", "kvtier.server"),
    ("kvtier.integrations",),
    ("kvtier.quality",),  # the codec quality gate: a trained model over integrations
    ("kvtier.demo", "kvtier.bench", "kvtier.cli", "kvtier"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest prefix wins
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                candidate = (len(prefix), index)
                if best is None or candidate > best:
                    best = candidate
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


def imports_of(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from kvtier.storage import records` imports the module kvtier.storage.records
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def kvtier_imports_of(path: Path, module: str) -> set[str]:
    return {name for name in imports_of(path, module) if name.split(".")[0] == "kvtier"}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in SRC.joinpath("kvtier").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        # keep only names that are modules (drop `from kvtier.x import SomeClass` extras)
        graph[module] = {name for name in kvtier_imports_of(path, module) if name in paths}
        graph[module] -= {module}
    return graph


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_the_package_imports_nothing_from_beside_it() -> None:
    # benchmarks/ and tests/ are not in the wheel: a package module importing them works in a
    # checkout and breaks every installed copy.
    beside = ("benchmarks", "tests")
    found = [
        f"{module_name(path)} imports {name}"
        for path in SRC.joinpath("kvtier").rglob("*.py")
        for name in imports_of(path, module_name(path))
        if name.split(".")[0] in beside
    ]
    assert found == []


def test_private_modules_are_imported_only_by_their_package() -> None:
    # kvtier/engine/_core.py is the engine's own: a module outside kvtier.engine that imports
    # it depends on what the package is free to change.
    found = [
        f"{module} imports {name}"
        for module, names in import_graph().items()
        for name in names
        if name.rpartition(".")[2].startswith("_")
        and not module.startswith(name.rpartition(".")[0] + ".")
        and module != name.rpartition(".")[0]
    ]
    assert found == []


def test_no_import_runs_up_a_layer() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module) and not module.startswith(target + ".")
    ]
    assert upward == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def without_package_faces(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package's __init__ that re-exports its children is imported implicitly by every child;
    # an edge child -> parent package is the interpreter's doing, not a dependency.
    return {
        module: {t for t in targets if not module.startswith(t + ".")}
        for module, targets in graph.items()
    }


def test_no_import_circles() -> None:
    circles = [g for g in strongly_connected(without_package_faces(import_graph())) if len(g) > 1]
    assert circles == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_circle_finder_finds_circles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert [g for g in strongly_connected(graph) if len(g) > 1] == expected
