"""The how-to guides run, and the site shows the figures of their run.

Each guide ``docs/guides/<name>.py`` is executed cell by cell in its own process by
``docs/hooks/guides.py`` (slow tier: they train estimators), which replaces
``docs/guides/runs/<name>/`` with the figures the guide saved and ``run.json``. The
quick tests check that every guide has a run of its current text whose figures are the
ones its Markdown shows, that the hook renders code, output and figures into a page, and
that the built site's guide pages embed those figures byte for byte.
"""

import html as html_text
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.py"))
NAMES = [path.stem for path in GUIDES]


def _hook():
    spec = importlib.util.spec_from_file_location("guides", ROOT / "docs/hooks/guides.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _hook()


def _markdown(path):
    return "\n".join(c.source for c in hook.cells(path.read_text("utf-8")) if c.kind == "markdown")


def test_there_are_the_six_guides_of_the_nav():
    assert set(NAMES) >= {
        "train_with_callbacks",
        "diagnose_sbi_posterior",
        "images_and_time_series",
        "flow_matching_and_score",
        "samples_only",
        "fix_a_posterior",
    }
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for name in NAMES:
        assert f"guides/{name}.md" in nav, f"{name} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("name", NAMES)
def test_guide_runs_and_saves_the_figures_it_shows(name, tmp_path):
    """Run the guide as CI does; it must save exactly the figures its Markdown embeds."""
    path = ROOT / "docs" / "guides" / f"{name}.py"
    started = time.time()
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "docs/hooks/guides.py"), str(path)],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, f"{name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    record = hook.load_run(name)
    assert record["script_sha256"] == hook.script_hash(path)
    folder = hook.RUNS / name
    assert (folder / "run.json").stat().st_mtime >= started
    assert record["figures"], f"{name} saved no figure under figures/"
    assert sorted(record["figures"]) == sorted(set(hook.figure_links(_markdown(path))))
    for figure in record["figures"]:
        png = folder / figure
        assert png.stat().st_mtime >= started, figure
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure
    code_cells = [c for c in hook.cells(path.read_text("utf-8")) if c.kind == "code"]
    assert len(record["outputs"]) == len(code_cells)
    assert any(output.strip() for output in record["outputs"]), f"{name} printed nothing"
    assert not list(tmp_path.iterdir()), "a guide wrote outside its temporary folder"


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_run_is_of_the_current_guide(name):
    """The figures and output on the site belong to this text of the guide: edit a
    guide, rerun it (``python docs/hooks/guides.py docs/guides/<name>.py``)."""
    path = ROOT / "docs" / "guides" / f"{name}.py"
    record = hook.load_run(name)
    assert record is not None, f"{name} has never run: no docs/guides/runs/{name}/run.json"
    assert record["script_sha256"] == hook.script_hash(path), f"{name} changed since its run"
    assert sorted(record["figures"]) == sorted(set(hook.figure_links(_markdown(path))))
    for figure in record["figures"]:
        assert (hook.RUNS / name / figure).is_file(), figure
    assert record["commit"], "the run does not name its commit"


def test_cells_split_markdown_and_code_and_keep_line_numbers():
    script = (
        "import os\n"
        "# %% [markdown]\n# # Title\n#\n# Text with ![a](figures/a.png).\n\n"
        "# %%\nx = 1\nprint(x)\n\n# %% [markdown]\n# ![b](figures/b.png)\n"
    )
    cells = hook.cells(script)
    assert [(c.kind, c.line) for c in cells] == [
        ("code", 1), ("markdown", 3), ("code", 8), ("markdown", 12),
    ]  # fmt: skip
    assert cells[1].source == "# Title\n\nText with ![a](figures/a.png)."
    assert cells[2].source == "x = 1\nprint(x)"
    assert hook.figure_links(cells[1].source + cells[3].source) == ["a.png", "b.png"]
    with pytest.raises(ValueError, match="must start with '# '"):
        hook.cells("# %% [markdown]\n#no space\n")


def test_render_puts_output_after_its_code_and_points_figures_at_the_run(tmp_path):
    guide = tmp_path / "demo.py"
    guide.write_text(
        "# %% [markdown]\n# # Demo\n\n# %%\nprint('hello')\n\n"
        "# %%\nquiet = 1\n\n# %% [markdown]\n# ![plot](figures/p.png)\n",
        encoding="utf-8",
    )
    runs = tmp_path / "runs"
    (runs / "demo").mkdir(parents=True)
    record = {
        "script_sha256": hook.script_hash(guide), "commit": "abc1234", "date": "2026-11-28",
        "uncommitted_changes": False, "seconds": 3.2, "cpu_count": 2,
        "outputs": ["hello\n", ""], "figures": ["p.png"],
    }  # fmt: skip
    (runs / "demo" / "run.json").write_text(json.dumps(record), encoding="utf-8")
    page = hook.render(guide, runs)
    assert page.index("# Demo") < page.index("commit abc1234") < page.index("print('hello')")
    assert "```python\nprint('hello')\n```\n\n```text\nhello\n```" in page
    assert "```python\nquiet = 1\n```\n\n![plot](runs/demo/p.png)" in page  # no empty output
    assert "figures/p.png" not in page


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sources = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.sources += [value for key, value in attrs if key == "src"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
    pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-6000:]}"
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_site_page_embeds_the_figures_of_the_run(site, name):
    page = site / "guides" / name / "index.html"
    html = page.read_text(encoding="utf-8")
    parser = _Images()
    parser.feed(html)
    embedded = {}
    for source in parser.sources:
        target = (page.parent / source).resolve()
        if target.is_relative_to(site / "guides" / "runs"):
            embedded[target.name] = target
    record = hook.load_run(name)
    assert sorted(embedded) == sorted(record["figures"])
    for figure, target in embedded.items():
        assert target.read_bytes() == (hook.RUNS / name / figure).read_bytes(), figure
    assert record["commit"] in html
    # the code is on the page, and so is what it printed
    text = html_text.unescape(re.sub(r"<[^>]+>", "", html))
    first_output = next(output for output in record["outputs"] if output.strip())
    assert first_output.strip().splitlines()[0] in text
