"""The documentation site: `mkdocs build --strict` passes and documents every public name.

The strict build fails on a broken link or anchor between pages, a link to a repository
file that does not exist, a docstring parameter that is not in the signature, and an
unresolved cross-reference: a renamed function breaks the build, not the reader.
"""

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
pytest.importorskip("mkdocstrings", reason="the docs extra (mkdocstrings) is not installed")
pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")

import calib_lightning
import calib_lightning.functional

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-6000:]}"
    return out


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(value for key, value in attrs if key == "id" and value)


def _api_ids(site):
    parser = _Ids()
    pages = sorted((site / "api").rglob("*.html"))
    assert len(pages) >= 10, [p.name for p in pages]
    for page in pages:
        parser.feed(page.read_text(encoding="utf-8"))
    return parser.ids


def _resolve(path):
    """The object a dotted path names (a module, or attributes of the longest module)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _documented(ids, module, name):
    """Whether an anchor in ``ids`` documents ``module.name``: the object at the anchor's
    path (``calib_lightning.metrics.KCCSD`` for ``cl.KCCSD``) is the exported one."""
    target = getattr(module, name)
    for anchor in ids:
        if anchor == f"{module.__name__}.{name}" or anchor.endswith(f".{name}"):
            try:
                if _resolve(anchor) is target:
                    return True
            except (ImportError, AttributeError):
                continue
    return False


def test_strict_build_writes_every_page(site):
    for page in (
        "index.html",
        "getting-started/index.html",
        "benchmarks/index.html",
        "changelog/index.html",
        "design/index.html",
        "api/functional/index.html",
    ):
        assert (site / page).is_file(), page
    # the benchmarks page is examples/benchmarks/README.md, and its result tables came along
    benchmarks = (site / "benchmarks/index.html").read_text(encoding="utf-8")
    assert "Benchmarks and measurements" in benchmarks
    assert any((site / "examples/benchmarks/results").rglob("*.html"))


@pytest.mark.parametrize(
    "module", [calib_lightning, calib_lightning.functional], ids=lambda m: m.__name__
)
def test_api_reference_lists_every_public_name(site, module):
    ids = _api_ids(site)
    missing = [name for name in module.__all__ if not _documented(ids, module, name)]
    assert not missing, f"{module.__name__}.__all__ names without an API entry: {missing}"


def test_documented_checks_the_object_not_the_name():
    ids = {"calib_lightning.metrics.KCCSD", "calib_lightning.functional.rank_ecdf"}
    assert _documented(ids, calib_lightning, "KCCSD")
    assert _documented(ids, calib_lightning.functional, "rank_ecdf")
    assert not _documented(ids, calib_lightning, "TARP")
    # an anchor with the right last part but another object does not count
    assert not _documented({"calib_lightning.metrics.KCCSD.compute"}, calib_lightning, "KCCSD")


def test_home_page_has_the_readme_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    home = (ROOT / "docs/index.md").read_text(encoding="utf-8")
    for tag in ("demo-command", "test-command"):
        block = re.search(rf"<!-- {tag} -->\n(```bash\n.*?\n```)\n<!-- /{tag} -->", readme, re.S)
        assert block is not None, tag
        assert block.group(1) in home, f"docs/index.md lost README's {tag}"


def _hook(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docstring_markup_becomes_markdown():
    to_markdown = _hook("griffe_rst").to_markdown
    text = (
        "Uses :math:`\\alpha` and :func:`~calib_lightning.functional.rank_ecdf`,\n"
        ":class:`calib_lightning.KCCSD`, :meth:`the save <Diagnosis.save>`.\n\n"
        "    .. math::\n        d^2 = x\n\n    after\n\nExample:\n    >>> 1\n    1\n"
    )
    assert to_markdown(text) == (
        "Uses $\\alpha$ and `rank_ecdf`,\n`calib_lightning.KCCSD`, `the save`.\n\n"
        "    $$\n    d^2 = x\n    $$\n\n    after\n\nExamples:\n    >>> 1\n    1\n"
    )


def test_references_become_a_list():
    to_markdown = _hook("griffe_rst").to_markdown
    text = (
        'Text.\n\nReferences:\n    Glaser, Widmann. "Fast\n    Calibration Tests." UAI 2023.\n'
        '    Guo, Pleiss. "On Calibration." ICML 2017.\n'
    )
    assert to_markdown(text) == (
        'Text.\n\nReferences:\n    - Glaser, Widmann. "Fast Calibration Tests." UAI 2023.\n'
        '    - Guo, Pleiss. "On Calibration." ICML 2017.\n'
    )


def test_links_to_repository_files_point_into_the_site():
    hook = _hook("repo_links")
    assert hook._site_path("docs/design.md") == "design.md"
    assert hook._site_path("examples/benchmarks/README.md") == "benchmarks.md"
    assert hook._site_path("examples/benchmarks/results/x.md") == "examples/benchmarks/results/x.md"
    source = ROOT / "docs" / "design.md"
    assert hook._repo_target(source, "../README.md#quick-start") == ("README.md", "quick-start")
    assert hook._repo_target(source, "../no_such_file.md") is None  # left for mkdocs to flag
    assert hook._repo_target(source, "https://example.org") is None
    # GitHub needs `\|` in a table's code span; the site's tables show the pipe alone
    assert hook._table_pipes("| `q(t \\| x)` | a \\| b |\n`c \\| d`") == (
        "| `q(t | x)` | a \\| b |\n`c \\| d`"
    )
    chunks = hook._outside_fences("a [x](y)\n```\n[not](a link)\n```\nb\n")
    assert [prose for prose, _ in chunks] == [True, False, True]
