"""The longest chain of module-level imports between the package's own modules.

A chain A -> B -> C means A imports B when A is imported, and B imports C. Imports inside
functions are not counted (they run when the function runs); package `__init__` modules are
nodes like any other. CI runs this with `--max 8`:

    python scripts/check_import_depth.py --max 8
    python scripts/check_import_depth.py --all      # with function-level imports too
"""

import argparse
import ast
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mlx_ternary"


def modules(root: Path) -> dict:
    """{dotted name: (path, is_package)} of every module of the package."""
    out = {}
    for path in (root / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def targets(node, name: str, is_package: bool, known: dict) -> set:
    """The package's modules one import statement of module `name` imports."""
    if isinstance(node, ast.Import):
        wanted = [a.name for a in node.names]
    else:
        base = name.split(".") if is_package else name.split(".")[:-1]
        if node.level:
            base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in known]
        wanted = subs + ([prefix] if len(subs) < len(node.names) else [])
    out = set()
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph(root: Path, function_level: bool) -> dict:
    known = modules(root)
    graph = {}
    for name, (path, is_package) in known.items():
        tree = ast.parse(path.read_text())
        if function_level:
            nodes = ast.walk(tree)
        else:  # module level: top-level statements, and inside top-level if/try blocks
            nodes = (
                n
                for stmt in tree.body
                for n in (ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt])
            )
        edges = set()
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= targets(node, name, is_package, known)
        graph[name] = edges
    return graph


def longest_chain(graph: dict) -> list:
    sys.setrecursionlimit(10_000)
    visiting = set()

    @lru_cache(maxsize=None)
    def chain(name: str) -> tuple:
        visiting.add(name)
        best = (name,)
        for target in sorted(graph[name]):
            if target in visiting:
                raise SystemExit(f"import cycle through {name} and {target}")
            tail = chain(target)
            if 1 + len(tail) > len(best):
                best = (name, *tail)
        visiting.discard(name)
        return best

    return list(max((chain(m) for m in sorted(graph)), key=len))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=None, help="fail when the chain is longer")
    ap.add_argument("--all", action="store_true", help="count function-level imports too")
    ap.add_argument("--root", type=Path, default=ROOT, help="a checkout (default: this one)")
    args = ap.parse_args()
    chain = longest_chain(import_graph(args.root, args.all))
    print(f"{len(chain)} modules: " + " -> ".join(chain))
    if args.max is not None and len(chain) > args.max:
        sys.exit(f"the longest import chain has {len(chain)} modules; at most {args.max}")


if __name__ == "__main__":
    main()
