"""The import circles of vmplane, found on grimp's import graph (import-linter's own library).

    python scripts/import_cycles.py            print each circle; exit 1 when there is any
    python scripts/import_cycles.py --report   also the largest modules (lines) and classes (lines, methods)

The graph holds every import of the package: at module level, under `if TYPE_CHECKING:` and inside
functions (a lazy import is a circle all the same: it only hides it until run time). A circle is a
strongly connected component of that graph (Tarjan's algorithm) with more than one module, or a module
that imports itself; each is printed as one closed path through it, then every import between its modules
with its line (`lazy`: inside a function).
tests/test_layers.py runs `cycles()` in-process; scripts/lint.sh runs this file.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grimp

PACKAGE = "vmplane"
TOP = 15  # rows of each --report table


def import_graph(package: str = PACKAGE) -> grimp.ImportGraph:
    """The package's imports, those under TYPE_CHECKING and inside functions included."""
    return grimp.build_graph(package, include_external_packages=False, exclude_type_checking_imports=False)


def edges_of(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Each module and the modules it imports directly."""
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found


def closed_path(component: list[str], edges: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(edges.get(node, ())):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return [start]  # (unreachable for a component found by Tarjan)


@dataclass(frozen=True)
class Circle:
    modules: list[str]  # the strongly connected component, sorted
    path: list[str]  # one closed path through it (first == last)
    lines: list[str]  # "a -> b (l.12 lazy)" for each import inside the component


def cycles(package: str = PACKAGE) -> list[Circle]:
    """The package's import circles, largest first."""
    graph = import_graph(package)
    edges = edges_of(graph)
    circles = []
    for component in strongly_connected(edges):
        if len(component) == 1 and component[0] not in edges[component[0]]:
            continue
        inside = [(a, b) for a in component for b in sorted(edges[a]) if b in component]
        circles.append(Circle(component, closed_path(component, edges), [_step(graph, a, b) for a, b in inside]))
    return sorted(circles, key=lambda c: (-len(c.modules), c.modules))


def _step(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    where = ", ".join(f"l.{d['line_number']}{' lazy' if d.get('is_lazy') else ''}" for d in details)
    return f"{importer} -> {imported} ({where})"


# -- the report of sizes ------------------------------------------------------------------------
@dataclass(frozen=True)
class ClassSize:
    name: str  # module.Class
    lines: int
    methods: int


def module_files(package: str = PACKAGE) -> dict[str, Path]:
    """Each module of the package and its file, found where Python imports the package from."""
    root = Path(__import__(package).__file__).parent  # type: ignore[arg-type]
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def largest_modules(files: Mapping[str, Path], top: int = TOP) -> list[tuple[str, int]]:
    sizes = [(name, len(path.read_text().splitlines())) for name, path in files.items()]
    return sorted(sizes, key=lambda s: (-s[1], s[0]))[:top]


def largest_classes(files: Mapping[str, Path], top: int = TOP) -> list[ClassSize]:
    found = []
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append(ClassSize(f"{name}.{node.name}", lines, methods))
    return sorted(found, key=lambda c: (-c.lines, c.name))[:top]


def report(package: str = PACKAGE, top: int = TOP) -> str:
    files = module_files(package)
    out = [f"largest modules of {package} (lines; {len(files)} modules, {sum(_lines(files))} lines):"]
    out += [f"  {lines:6d}  {name}" for name, lines in largest_modules(files, top)]
    out.append("largest classes (lines, methods):")
    out += [f"  {c.lines:6d} {c.methods:4d}  {c.name}" for c in largest_classes(files, top)]
    return "\n".join(out)


def _lines(files: Mapping[str, Path]) -> Iterable[int]:
    return (len(p.read_text().splitlines()) for p in files.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--package", default=PACKAGE)
    parser.add_argument("--report", action="store_true", help="also the largest modules and classes")
    args = parser.parse_args(argv)
    circles = cycles(args.package)
    graph_size = len(import_graph(args.package).modules)
    if circles:
        print(f"{len(circles)} import circle(s) in {args.package} ({graph_size} modules):")
        for n, circle in enumerate(circles, 1):
            print(f"{n}. {len(circle.modules)} modules, e.g. {' -> '.join(circle.path)}; their imports of one another:")
            for line in circle.lines:
                print(f"     {line}")
    else:
        print(f"no import circle in {args.package} ({graph_size} modules)")
    if args.report:
        print(report(args.package))
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
