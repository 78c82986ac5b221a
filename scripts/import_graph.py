"""The import picture of a package: files per folder, import arrows between its own modules,
import levels (the longest chain of imports, after folding circles into one node), circles, and
the longest module of each folder. Reads the source with `ast`; imports nothing it measures.

    python scripts/import_graph.py [engine] [--edges]

Every `import` / `from ... import` counts, those inside functions included (a lazy import is
still a dependency); `--module-level` counts only those that run at import time. A package `__init__` that only re-exports counts like any module.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run at import: the module body and its if/try blocks, not functions,
    classes' methods or `if TYPE_CHECKING:` blocks."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                todo += node.orelse
            else:
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def imports_of(path: Path, name: str, is_package: bool, known: set[str], module_level: bool = False) -> set[str]:
    """Modules of `known` that the module `name` (at `path`) imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in (_module_level(tree) if module_level else ast.walk(tree)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            # the longest known prefix: `from engine.store import catalog` names engine.store.catalog
            parts = t.split(".")
            for k in range(len(parts), 0, -1):
                cand = ".".join(parts[:k])
                if cand in known:
                    if cand != name:
                        out.add(cand)
                    break
    return out


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="engine", help="folder of the package (default: engine)")
    parser.add_argument("--edges", action="store_true", help="also list every arrow")
    parser.add_argument("--module-level", action="store_true",
                        help="count only imports that run when the module is imported (not those inside "
                        "functions or under TYPE_CHECKING)")
    args = parser.parse_args(argv)
    root = Path(args.package).resolve()
    files = sorted(root.rglob("*.py"))
    names = {module_name(root, f): f for f in files}
    known = set(names)
    edges = {n: imports_of(f, n, f.name == "__init__.py", known, args.module_level) for n, f in names.items()}
    # a module importing its own package's __init__ only to reach a sibling is still an arrow
    comps = strongly_connected(sorted(names), edges)
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    cedges: dict[int, set[int]] = defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            if comp_of[a] != comp_of[b]:
                cedges[comp_of[a]].add(comp_of[b])
    level: dict[int, int] = {}

    def depth(c: int) -> int:  # imports nothing of its own package: level 1
        if c not in level:
            level[c] = 1 + max((depth(d) for d in cedges[c]), default=0)
        return level[c]

    sys.setrecursionlimit(10_000)
    levels = max((depth(i) for i in range(len(comps))), default=0)
    circles = [c for c in comps if len(c) > 1]
    folders: dict[str, list[Path]] = defaultdict(list)
    for f in files:
        folders[str(f.parent.relative_to(root.parent))].append(f)
    what = "module-level import" if args.module_level else "import"
    print(f"{root.name}: {len(files)} files in {len(folders)} folders, {sum(len(b) for b in edges.values())} "
          f"{what} arrows, {levels} {what} levels, {len(circles)} circles")
    print(f"{'folder':<24}{'files':>6}{'lines':>7}  longest module")
    for folder, fs in sorted(folders.items()):
        lines = {f: len(f.read_text(encoding='utf-8').splitlines()) for f in fs}
        longest = max(fs, key=lambda f: lines[f])
        print(f"{folder:<24}{len(fs):>6}{sum(lines.values()):>7}  {longest.name} ({lines[longest]} lines)")
    for c in circles:
        print("circle: " + " <-> ".join(c))
    if args.edges:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
