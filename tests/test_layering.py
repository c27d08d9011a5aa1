"""The package's layering, read from its import statements (``ast``, nothing is imported).

Data flows one way: callback -> evaluation layer / posterior adapter -> metric ->
functional core -> logger. These tests fail when a module reaches the wrong way.
Run this file as a script to print the import graph between the package's parts.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "calib_lightning"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``calib_lightning...`` and top-level third-party module ``path`` imports."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = name.split(".")[: -node.level + (path.name == "__init__.py")]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def _part(module: str) -> str:
    """The part of the package a module belongs to: ``functional``, ``metrics``, ..."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Package part -> the package parts it imports."""
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        targets = {_part(m) for m in _imports(path) if m.startswith("calib_lightning.")} - {
            _part(name)
        }
        graph.setdefault(_part(name), set()).update(targets)
    return graph


#: what each part of the package may import: every part has a rule, and the rules form
#: floors (a part imports only parts below it; ``_utils``, ``results`` and ``tasks`` import
#: nothing of the package). The floors, bottom up: _utils, results, tasks; kernels,
#: posteriors, testing; functional, evaluation; classifiers, misspecification; metrics,
#: losses, baselines, plots; recalibration; diagnosis, callbacks; the faces.
ALLOWED = {
    "_utils": set(),
    "results": set(),
    "tasks": set(),
    "kernels": {"_utils"},
    "posteriors": {"_utils"},
    "testing": {"_utils"},
    # the functional core sees tensors only: no models, classifiers, state or logging
    "functional": {"_utils", "kernels", "results"},
    # the evaluation layer runs models; it does not compute statistics or log
    "evaluation": {"_utils", "posteriors"},
    "classifiers": {"_utils", "functional"},
    "misspecification": {"_utils", "evaluation", "functional", "results", "classifiers"},
    # metrics know nothing about Lightning or figures
    "metrics": {
        "_utils",
        "classifiers",
        "evaluation",
        "functional",
        "kernels",
        "posteriors",
        "results",
        "misspecification",
    },
    "losses": {"_utils", "evaluation", "functional", "kernels", "posteriors"},
    "baselines": {"_utils", "classifiers", "functional", "kernels"},
    "plots": {"_utils", "functional", "misspecification", "results"},
    # post-hoc maps build on posteriors, the evaluation layer and the functional core;
    # they do not log or draw
    "recalibration": {"_utils", "evaluation", "functional", "losses", "posteriors"},
    "diagnosis": {
        "_utils",
        "evaluation",
        "functional",
        "metrics",
        "misspecification",
        "plots",
        "posteriors",
        "recalibration",
        "results",
    },
    "callbacks": {
        "_utils",
        "baselines",
        "evaluation",
        "functional",
        "metrics",
        "misspecification",
        "plots",
        "posteriors",
        "recalibration",
        "results",
    },
    "__main__": {"callbacks", "diagnosis", "posteriors"},
    # the Keras callback runs the Lightning callbacks' checks; nothing imports it
    "keras": {"_utils", "callbacks"},
    "calib_lightning": {
        "baselines",
        "classifiers",
        "evaluation",
        "functional",
        "kernels",
        "losses",
        "metrics",
        "misspecification",
        "posteriors",
        "recalibration",
        "tasks",
    },
}

#: third-party modules a part must not import
THIRD_PARTY = {
    "functional": {"lightning", "matplotlib"},
    "metrics": {"lightning", "matplotlib"},
    "evaluation": {"lightning", "matplotlib"},
    "posteriors": {"lightning", "matplotlib"},
    "recalibration": {"lightning", "matplotlib"},
}


def test_every_part_has_a_rule() -> None:
    assert sorted(set(import_graph()) - set(ALLOWED)) == []


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_parts_import_only_downstream(part: str) -> None:
    bad = []
    for name, path in modules().items():
        if _part(name) != part:
            continue
        for module in _imports(path):
            top = module.split(".")[0]
            if module.startswith("calib_lightning."):
                target = _part(module)
                if target != part and target in ALLOWED and target not in ALLOWED[part]:
                    bad.append(f"{name} imports {module}")
            elif top in THIRD_PARTY.get(part, ()):
                bad.append(f"{name} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_rules_have_floors() -> None:
    """No two parts may import each other, through any chain of rules."""

    def below(part: str, seen: frozenset[str]) -> None:
        for lower in ALLOWED.get(part, ()):
            assert lower not in seen, f"{lower} and {part} may import each other"
            below(lower, seen | {lower})

    for part in ALLOWED:
        below(part, frozenset({part}))


def module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at module level or in a function)."""
    names = modules()
    graph = {}
    for name, path in names.items():
        targets = set()
        for target in _imports(path):
            while target and target not in names:  # `from a.b import c`: the module a.b
                target = target.rpartition(".")[0]
            if target and target not in (name, "calib_lightning"):
                targets.add(target)
        graph[name] = targets
    return graph


def test_no_import_circles() -> None:
    """No module imports, through others, one that imports it (a package's ``__init__``
    counts as a module: a submodule importing its own package is a circle too)."""
    graph, found = module_graph(), []

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {name: reach(name) for name in graph}
    for name in graph:
        back = sorted(m for m in graph[name] if name in reachable[m])
        found += [f"{name} -> {m} -> ... -> {name}" for m in back]
    assert found == []


def test_every_module_has_a_docstring_and_all() -> None:
    missing = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        names = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        }
        if ast.get_docstring(tree) is None or "__all__" not in names:
            missing.append(name)
    assert missing == []


def test_public_namespace_lists_only_package_names() -> None:
    import calib_lightning as cl

    for name in cl.__all__:
        value = getattr(cl, name)
        owner = getattr(value, "__module__", None) or getattr(value, "__name__", "")
        assert owner.startswith("calib_lightning"), f"cl.{name} comes from {owner}"


def test_every_name_in_every_all_exists() -> None:
    """``from module import *`` works for every module: each name in an ``__all__`` is
    defined (``functional.__all__`` listed a ``kccsd_test`` that was not)."""
    import importlib
    import importlib.util

    missing = []
    for name in modules():
        if name == "calib_lightning.keras" and importlib.util.find_spec("keras") is None:
            continue  # needs Keras (the extra calib_lightning[bayesflow])
        module = importlib.import_module(name)
        missing += [f"{name}.{n}" for n in module.__all__ if not hasattr(module, n)]
    assert missing == []


if __name__ == "__main__":
    sizes = {name: len(p.read_text().splitlines()) for name, p in modules().items()}
    for part, targets in sorted(import_graph().items()):
        print(f"{part:16s} -> {', '.join(sorted(targets)) or '(nothing in the package)'}")
    print()
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1])[
        : int(sys.argv[1]) if len(sys.argv) > 1 else 15
    ]:
        print(f"{size:5d}  {name}")


def test_importing_the_package_imports_neither_keras_nor_bayesflow() -> None:
    """The BayesFlow adapter recognizes an approximator by its class alone, so a user
    without Keras pays nothing for it (``calib_lightning.keras`` is imported on demand)."""
    import subprocess

    code = (
        "import sys, calib_lightning; "
        "print(sorted(m for m in ('keras', 'bayesflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
