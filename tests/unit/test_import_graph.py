"""The package's imports run one way: no module imports, directly or through others, a module that imports it, and
the layers keep their direction (strategies and codecs know nothing of the transport). Read from the source with
``ast``: every import counts, also those inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Dict, List, Set

import swarm_opt

PACKAGE = Path(swarm_opt.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, known: Set[str]) -> Set[str]:
    """The package's modules that ``path`` imports (a module importing its own package is no cycle)."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph() -> Dict[str, Set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, set(files)) for name, path in files.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    found.append(sorted(component))
    return found


def _describe(graph: Dict[str, Set[str]], component: List[str]) -> str:
    members = set(component)
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in component)


def test_the_cycle_finder_finds_a_cycle_through_three_modules_and_none_in_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "swarm_opt.optimizer" in graph  # the whole package was read
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(graph, c) for c in found)


def _reaches(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_strategies_and_codecs_import_nothing_of_the_transport_and_codecs_no_strategy():
    graph = import_graph()
    transport = ("swarm_opt._hivemind", "swarm_opt.gloo_lane", "swarm_opt.round", "swarm_opt.optimizer")
    for name in graph:
        if name.startswith(("swarm_opt.strategies", "swarm_opt.compression")):
            reached = _reaches(graph, name)
            assert not [m for m in reached if m.startswith(transport)], (name, sorted(reached))
        if name.startswith("swarm_opt.compression"):
            assert not [m for m in _reaches(graph, name) if m.startswith("swarm_opt.strategies")], name


def _hivemind_reach(path: Path) -> Set[str]:
    """The hivemind modules (beyond ``swarm_opt._hivemind.PUBLIC``) and private names that ``path`` imports."""
    from swarm_opt._hivemind import PUBLIC

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            targets = []
            for alias in node.names:
                try:
                    is_module = importlib.util.find_spec(f"{node.module}.{alias.name}") is not None
                except (ImportError, ValueError):
                    is_module = False
                targets.append(f"{node.module}.{alias.name}" if is_module else node.module or "")
                if alias.name.startswith("_") and (node.module or "").split(".")[0] == "hivemind":
                    found.add(f"{node.module}.{alias.name}")
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == "hivemind" and t not in PUBLIC)
    return found


def test_outside_of_swarm_opt_hivemind_only_the_listed_modules_reach_into_hivemind():
    from swarm_opt._hivemind import REACHED_FROM_OUTSIDE

    reaching = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if not name.startswith("swarm_opt._hivemind") and (reach := _hivemind_reach(path)):
            reaching[name] = sorted(reach)
    assert "swarm_opt.compression.codecs" in reaching  # the check sees a known one
    assert set(reaching) == set(REACHED_FROM_OUTSIDE), reaching
