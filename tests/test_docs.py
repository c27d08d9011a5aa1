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
import calib_lightning.callbacks
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
    "module",
    [calib_lightning, calib_lightning.callbacks, calib_lightning.functional],
    ids=lambda m: m.__name__,
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


_CODE_LINK = re.compile(r"\[`([\w.]+)`\](?:\[([\w.]+)\]|\(([\w-]+\.md)\))")


def _api_index_links():
    """The code links of ``docs/api/index.md``: for each link text's last part (``KCCSD``
    for ``calib_lightning.metrics.KCCSD``), the dotted paths it links to; a link to a
    page (``baselines.md``) stands for the modules that page documents (``::: ...``)."""
    text = (ROOT / "docs" / "api" / "index.md").read_text(encoding="utf-8")
    links: dict[str, set[str]] = {}
    for match in _CODE_LINK.finditer(text):
        label, target, page = match.groups()
        if page is None:
            targets = {target}
        else:
            source = (ROOT / "docs" / "api" / page).read_text(encoding="utf-8")
            targets = set(re.findall(r"^::: ([\w.]+)", source, re.MULTILINE))
        links.setdefault(label.rsplit(".", 1)[-1], set()).update(targets)
    return links


def _linked(links, module, name):
    target = getattr(module, name)
    for path in links.get(name, ()):
        try:
            if _resolve(path) is target:
                return True
        except (ImportError, AttributeError):
            continue
    return False


@pytest.mark.parametrize(
    "module", [calib_lightning, calib_lightning.callbacks], ids=lambda m: m.__name__
)
def test_api_index_links_every_public_name(module):
    """docs/api/index.md says it lists the package's public names, each linked to the
    entry that documents it: every name of ``__all__`` is there, linked to that object."""
    links = _api_index_links()
    missing = [name for name in module.__all__ if not _linked(links, module, name)]
    assert not missing, (
        f"{module.__name__}.__all__ names not linked in docs/api/index.md: {missing}"
    )


def test_api_index_links_are_read_as_the_objects_they_name():
    links = {"KCCSD": {"calib_lightning.metrics.KCCSD"}, "TARP": {"calib_lightning.metrics.KCCSD"}}
    assert _linked(links, calib_lightning, "KCCSD")
    assert not _linked(links, calib_lightning, "TARP")  # a link to another object
    assert not _linked(links, calib_lightning, "LC2ST")  # no link at all
    assert _linked(_api_index_links(), calib_lightning, "baselines")  # through its page


#: the attributes through which a tag makes the browser load a file (``<link>`` aside)
_LOADS = {
    "script": ("src",),
    "img": ("src", "srcset"),
    "source": ("src", "srcset"),
    "iframe": ("src",),
    "video": ("src", "poster"),
    "audio": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "input": ("src",),
}


class _Page(HTMLParser):
    """What a built page loads and links: resource URLs, link targets, and for each
    table cell its column's header and the hrefs of the code elements in it."""

    def __init__(self):
        super().__init__()
        self.resources, self.hrefs, self.styles = [], [], []
        self.codes = []  # (column header, code text, href of the enclosing link or None)
        self.scripts = []
        self._headers, self._column, self._links, self._code, self._style = [], -1, [], None, False
        self._header_text = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in _LOADS.get(tag, ()):
            if attrs.get(name):
                self.resources += [
                    part.split()[0] for part in attrs[name].split(",") if part.strip()
                ]
        if tag == "script" and attrs.get("src"):
            self.scripts.append(attrs["src"])
        if (
            tag == "link"
            and attrs.get("href")
            and attrs.get("rel") not in ("canonical", "alternate")
        ):
            self.resources.append(attrs["href"])
        if attrs.get("style"):
            self.styles.append(attrs["style"])
        if tag == "style":
            self._style = True
        if tag == "a":
            self._links.append(attrs.get("href"))
            if attrs.get("href"):
                self.hrefs.append(attrs["href"])
        if tag == "tr":
            self._column = -1
        if tag == "table":
            self._headers = []
        if tag == "th":
            self._header_text = ""
        if tag in ("td", "th"):
            self._column += 1
        if tag == "code":
            self._code = ""

    def handle_endtag(self, tag):
        if tag == "a" and self._links:
            self._links.pop()
        if tag == "style":
            self._style = False
        if tag == "table":  # code after a table is in no column
            self._headers, self._column = [], -1
        if tag == "th" and self._header_text is not None:
            self._headers.append(self._header_text.strip())
            self._header_text = None
        if tag == "code" and self._code is not None:
            header = self._headers[self._column] if 0 <= self._column < len(self._headers) else None
            link = next((href for href in reversed(self._links) if href), None)
            self.codes.append((header, self._code, link))
            self._code = None

    def handle_data(self, data):
        if self._style:
            self.styles.append(data)
        if self._header_text is not None:
            self._header_text += data
        if self._code is not None:
            self._code += data


def _read_page(path):
    parser = _Page()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


_ELSEWHERE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
_CSS_URL = re.compile(r"""url\(\s*['"]?([^'")]+)|@import\s+['"]([^'"]+)""")


def test_the_site_loads_nothing_from_another_host(site):
    """Read offline, the site shows what it shows online: no page loads a script, a
    stylesheet, a font or an image from another host (MathJax and the fonts come with
    it), and no stylesheet imports one."""
    site = site.resolve()
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    found = []
    for page in pages:
        parsed = _read_page(page)
        urls = parsed.resources + [
            u for s in parsed.styles for m in _CSS_URL.finditer(s) for u in m.groups() if u
        ]
        found += [(page.relative_to(site).as_posix(), url) for url in urls if _ELSEWHERE.match(url)]
    for sheet in sorted(site.rglob("*.css")):
        text = sheet.read_text(encoding="utf-8", errors="replace")
        urls = [u for m in _CSS_URL.finditer(text) for u in m.groups() if u]
        found += [
            (sheet.relative_to(site).as_posix(), url) for url in urls if _ELSEWHERE.match(url)
        ]
    assert not found, f"{len(found)} loads from another host, e.g. {sorted(set(found))[:5]}"


def test_math_is_typeset_by_the_mathjax_served_with_the_site(site):
    """Each page with math loads the settings and then MathJax from the site itself, and
    the copy there holds every TeX extension and font file that MathJax asks for."""
    site = site.resolve()
    pages = [
        p for p in sorted(site.rglob("*.html")) if 'class="arithmatex"' in p.read_text("utf-8")
    ]
    assert len(pages) >= 10, [p.relative_to(site).as_posix() for p in pages]
    mathjax = site / "javascripts" / "mathjax"
    for page in pages:
        scripts = [(page.parent / src.split("?")[0]).resolve() for src in _read_page(page).scripts]
        assert mathjax / "tex-mml-chtml.js" in scripts, page
        settings = scripts.index((site / "javascripts" / "mathjax.js").resolve())
        assert settings < scripts.index(mathjax / "tex-mml-chtml.js"), (
            f"{page}: settings after MathJax"
        )
    assert (mathjax / "LICENSE").is_file(), "MathJax's license is not served with it"
    asked = set()
    for script in mathjax.rglob("*.js"):
        text = script.read_text(encoding="utf-8")
        # the loader's "source" map sends an alias ("[tex]/amsCd") to its file's name
        alias = dict(re.findall(r'"\[tex\]/([\w-]+)":"\[tex\]/([\w-]+)"', text))
        asked |= {
            f"input/tex/extensions/{alias.get(name, name)}.js"
            for name in re.findall(r"\[tex\]/([\w-]+)", text)
        }
        asked |= {
            f"output/chtml/fonts/woff-v2/{name}"
            for name in re.findall(r"MathJax_[\w-]+\.woff", text)
        }
    assert len(asked) > 40, sorted(asked)
    missing = sorted(path for path in asked if not (mathjax / path).is_file())
    assert not missing, f"MathJax asks for files the site does not serve: {missing}"


def _target(site, page, href):
    """The built file and anchor an ``href`` on ``page`` points to."""
    path, _, anchor = href.partition("#")
    target = (page.parent / path).resolve() if path else page
    if target.is_dir():
        target = target / "index.html"
    return target, anchor


def test_home_page_links_its_checks_into_the_api_and_the_guides(site):
    """The front page's table links each metric and callback to its API entry, and its
    text links every how-to guide."""
    site = site.resolve()
    page = site / "index.html"
    parsed = _read_page(page)
    cells = [
        (text, href) for header, text, href in parsed.codes if header in ("metric", "callback")
    ]
    assert len(cells) >= 18, cells
    unlinked = [text for text, href in cells if href is None]
    assert not unlinked, f"names in the front page's table that link nowhere: {unlinked}"
    for text, href in cells:
        target, anchor = _target(site, page, href)
        assert target.is_relative_to(site / "api"), f"{text} links outside the API: {href}"
        assert target.is_file(), f"{text}: {href}"
        if anchor:
            parser = _Ids()
            parser.feed(target.read_text(encoding="utf-8"))
            assert anchor in parser.ids, f"{text}: no anchor {anchor} on {target}"
    guides = {_target(site, page, href)[0] for href in parsed.hrefs}
    for guide in sorted((ROOT / "docs" / "guides").glob("*.py")):
        assert site / "guides" / guide.stem / "index.html" in guides, (
            f"the front page misses {guide.stem}"
        )


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
