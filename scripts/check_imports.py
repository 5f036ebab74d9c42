#!/usr/bin/env python3
"""Check Kestrel's import layering: no import cycle, no service importing another service.

The graph: every module under services/, shared/ and kernels/ (read with the stdlib `ast`,
nothing is imported), with an edge for each import of another module of those packages:
module-level imports and imports inside functions alike, relative ones resolved. Imports
under `if TYPE_CHECKING:` are left out: they never run, so they cannot form a cycle at run
time. `from pkg import name` is an edge to pkg.name when that is a module, else to pkg.

Offences, each printed on one line:
- cycle: a strongly connected set of modules (with one cycle through it as an example);
- cross-service: a module of services/<a>/ importing one of services/<b>/, a != b (only
  shared/ and kernels/ are common ground; services/cli.py, the dispatcher of
  `kestrel <command>`, may import each service's entry point);
- layering: a module of shared/ or kernels/ importing services/.

Usage: scripts/check_imports.py [--root DIR]. Exit code 0 when there is no offence, 1 when
there is one (docs/ARCHITECTURE.md §2; tests/unit/test_import_layering.py runs it in CI).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass, field

PACKAGES = ("services", "shared", "kernels")
DISPATCHER = "services.cli"  # may import every service's entry point
COMMON = ("shared", "kernels")


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` at `path`:`line` (path relative to the root)."""

    source: str
    target: str
    path: str
    line: int


@dataclass
class Graph:
    """modules: module name -> file path (relative to the root); edges: source -> target ->
    the first Edge seen for that pair."""

    modules: dict[str, str] = field(default_factory=dict)
    edges: dict[str, dict[str, Edge]] = field(default_factory=dict)


def _module_name(rel_path: str) -> str:
    parts = rel_path[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`, at any depth, except under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return sorted(out, key=lambda n: n.lineno)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: dict[str, str]) -> list[str]:
    """The modules of `known` that one import statement of `module` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return [_longest_known(n, known) for n in names if _longest_known(n, known)]
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        up = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
        base = ".".join(up + ([base] if base else []))
    out = []
    for alias in node.names:
        full = f"{base}.{alias.name}" if base else alias.name
        if full in known:
            out.append(full)
        elif _longest_known(base, known):
            out.append(_longest_known(base, known))
    return out


def _longest_known(name: str, known: dict[str, str]) -> str:
    """`name` or its longest prefix that is a module of `known` ("" when none)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in known:
            return cand
        parts.pop()
    return ""


def build_graph(root: str) -> Graph:
    """The import graph of PACKAGES under `root`. Raises SyntaxError for a file that does not
    parse (with its path)."""
    g = Graph()
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for fn in sorted(filenames):
                if fn.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, fn), root)
                    g.modules[_module_name(rel)] = rel
    for mod, rel in g.modules.items():
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=rel)
        is_pkg = rel.endswith("__init__.py")
        out = g.edges.setdefault(mod, {})
        for node in _imports(tree):
            for target in _targets(node, mod, is_pkg, g.modules):
                if target != mod and target not in out:
                    out[target] = Edge(mod, target, rel, node.lineno)
    return g


def find_cycles(g: Graph) -> list[list[str]]:
    """The import cycles: each strongly connected set of two or more modules (Tarjan's
    algorithm), as its sorted member list; the list is sorted too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []
    counter = 0
    for start in sorted(g.modules):
        if start in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        work = [(start, iter(sorted(g.edges.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(g.edges.get(nxt, {})))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
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
                    sccs.append(sorted(comp))
    return sorted(sccs)


def _example_cycle(g: Graph, comp: list[str]) -> list[str]:
    """A shortest cycle from comp[0] back to itself inside the component (BFS)."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(g.edges.get(node, {})):
                if nxt not in members:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if nxt not in prev:
                    prev[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return comp + [comp[0]]  # not reached for a strongly connected set


def _service(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 2 else None


def layering_offences(g: Graph) -> list[tuple[str, Edge]]:
    """(kind, edge) for each cross-service import and each import of services/ from shared/
    or kernels/, in path and line order."""
    out = []
    for mod in sorted(g.edges):
        for edge in g.edges[mod].values():
            top, target_top = mod.split(".")[0], edge.target.split(".")[0]
            if top in COMMON and target_top == "services":
                out.append(("layering", edge))
            elif mod != DISPATCHER and _service(mod) and _service(edge.target) \
                    and _service(mod) != _service(edge.target):
                out.append(("cross-service", edge))
    return sorted(out, key=lambda o: (o[1].path, o[1].line, o[1].target))


def describe_cycle(g: Graph, members: list[str]) -> str:
    """One line: the cycle's modules, and a shortest cycle through the first of them with
    the file and line of each import."""
    cycle = _example_cycle(g, members)
    hops = [f"{a} ({g.edges[a][b].path}:{g.edges[a][b].line})" for a, b in zip(cycle, cycle[1:])]
    return (f"cycle among {', '.join(members)}: " + " -> ".join(hops) + f" -> {cycle[-1]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the repository root (default: this script's)")
    a = ap.parse_args(argv)
    g = build_graph(a.root)
    offences = [describe_cycle(g, c) for c in find_cycles(g)]
    offences += [f"{kind}: {e.path}:{e.line}: {e.source} imports {e.target}"
                 for kind, e in layering_offences(g)]
    for line in offences:
        print(line)
    n_edges = sum(len(v) for v in g.edges.values())
    print(f"{len(g.modules)} modules, {n_edges} imports: "
          + (f"{len(offences)} offence(s)" if offences else "no cycle, no cross-service import"),
          file=sys.stderr)
    return 1 if offences else 0


if __name__ == "__main__":
    sys.exit(main())
