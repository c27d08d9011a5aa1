"""The shape of the package's code: what a maintainer meets, measured from the source.

For a checkout of the package (``--root``, default this one), read with ``ast`` (nothing
is imported):

* lines and modules, the median module, and the share of lines in docstrings;
* private modules at the package root, and ``# fmt: skip`` lines;
* the import graph between the package's parts (``functional``, ``metrics``, ...; a
  root module is a part of its own): arrows, and floors (the longest chain of parts, each
  importing the next), with every import counted, at module level or inside a function;
* import circles between modules (strongly connected sets of two or more modules);
* for each check of ``cl.diagnose``, the modules of ``diagnosis/`` that spell its name as
  a string.

    python examples/benchmarks/code_shape.py --name code_shape_after
    python examples/benchmarks/code_shape.py --root /path/to/old/checkout --name code_shape_before
    python examples/benchmarks/code_shape.py --smoke

Writes ``results/NAME.md`` (the table) and ``NAME.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import time
from pathlib import Path

from examples._smoke import add_smoke_argument, output_folder

RESULTS = Path(__file__).parent / "results"
CHECK_NAMES = (
    "kccsd",
    "ranks",
    "tarp",
    "joint_c2st",
    "recovery",
    "lc2st_nf",
    "lc2st",
    "misspecification",
    "support",
    "coverage_is",
    "balance",
)


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: -node.level + (path.name == "__init__.py")]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in out if m.startswith("calib_lightning")}


def docstring_lines(tree: ast.AST) -> int:
    total = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                total += body[0].end_lineno - body[0].lineno + 1
    return total


def part(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else pieces[0]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floors(graph: dict[str, set[str]]) -> int:
    """The longest chain of parts (cycles between parts counted once)."""
    memo: dict[str, int] = {}

    def depth(v: str, seen: frozenset[str]) -> int:
        if v in memo:
            return memo[v]
        below = [depth(w, seen | {v}) for w in graph.get(v, ()) if w not in seen and w != v]
        memo[v] = 1 + max(below, default=0)
        return memo[v]

    return max((depth(v, frozenset()) for v in graph), default=0)


def measure(root: Path) -> dict:
    package = root / "calib_lightning"
    paths = sorted(package.rglob("*.py"))
    names = {module_name(p, package): p for p in paths}
    lines, docs, sizes, skips = 0, 0, [], 0
    module_graph: dict[str, set[str]] = {}
    part_graph: dict[str, set[str]] = {}
    for name, path in names.items():
        text = path.read_text()
        tree = ast.parse(text)
        count = len(text.splitlines())
        lines, sizes = lines + count, [*sizes, count]
        docs += docstring_lines(tree)
        skips += sum("fmt: skip" in line for line in text.splitlines())
        targets = set()
        for target in imports(path, name):
            while target and target not in names:  # `from a.b import c`: module a.b
                target = target.rpartition(".")[0]
            if target and target != name and target != "calib_lightning":
                targets.add(target)
        module_graph[name] = targets
        part_graph.setdefault(part(name), set()).update(
            part(t) for t in targets if part(t) != part(name)
        )
    private_root = sorted(
        p.name
        for p in package.iterdir()
        if p.name.startswith("_") and p.name not in ("__init__.py", "__main__.py", "__pycache__")
    )
    spelled = {}
    for check in CHECK_NAMES:
        spelled[check] = sorted(
            p.relative_to(package / "diagnosis").as_posix()
            for p in (package / "diagnosis").rglob("*.py")
            if any(
                isinstance(n, ast.Constant) and n.value == check
                for n in ast.walk(ast.parse(p.read_text()))
            )
        )
    return {
        "lines": lines,
        "modules": len(paths),
        "median_module_lines": statistics.median(sizes),
        "docstring_share": round(docs / lines, 3),
        "private_root_modules": private_root,
        "fmt_skip_lines": skips,
        "part_arrows": sum(len(v) for v in part_graph.values()),
        "parts": len(part_graph),
        "floors": floors(part_graph),
        "module_circles": circles(module_graph),
        "check_name_spelled_in": spelled,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    parser.add_argument("--name", default="code_shape")
    add_smoke_argument(parser)
    args = parser.parse_args()
    root = Path(args.root)
    result = measure(root)
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    most = max(len(v) for v in result["check_name_spelled_in"].values())
    lines = [
        f"# The package's code, measured: {args.name}",
        "",
        f"Command: `python examples/benchmarks/code_shape.py --name {args.name}` on the "
        f"checkout at commit {commit}, {time.strftime('%Y-%m-%d')} (read with `ast`).",
        "",
        "| quantity | value |",
        "| --- | --- |",
        f"| lines | {result['lines']:,} |",
        f"| modules | {result['modules']} (median {result['median_module_lines']:.0f} lines) |",
        f"| docstring share of the lines | {result['docstring_share']:.1%} |",
        f"| private modules at the package root | {len(result['private_root_modules'])}: "
        f"{', '.join(result['private_root_modules']) or 'none'} |",
        f"| `# fmt: skip` lines | {result['fmt_skip_lines']} |",
        f"| import graph between parts | {result['parts']} parts, {result['part_arrows']} "
        f"arrows, {result['floors']} floors |",
        f"| import circles between modules | {len(result['module_circles'])}"
        + "".join(f"; {' <-> '.join(c)}" for c in result["module_circles"])
        + " |",
        f"| modules of `diagnosis/` spelling one check's name (most) | {most} |",
    ]
    folder = output_folder(RESULTS, args.smoke)
    (folder / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (folder / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
