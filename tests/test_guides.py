"""The how-to guides run, and the site shows the figures of their run.

Each guide ``docs/guides/<name>.py`` is executed cell by cell in its own process by
``docs/hooks/guides.py`` (slow tier: they train estimators), which writes the figures the
guide saved and ``run.json`` to a temporary folder (``--runs``): running the tests leaves
the checkout as it was, and the committed run in ``docs/guides/runs/<name>/`` is
refreshed only by hand (``python docs/hooks/guides.py docs/guides/<name>.py``). The
quick tests check that every guide has a committed run of its current text whose figures
are the ones its Markdown shows, that the hook renders code, output and figures into a
page, and that the built site's guide pages embed those figures byte for byte.
"""

import hashlib
import html as html_text
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.py"))
NAMES = [path.stem for path in GUIDES]
#: guides that need an optional dependency: skipped without it
OPTIONAL = {"check_a_bayesflow_model": "bayesflow"}


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


def _git_checkout():
    """Whether the tests run in a git checkout of the repository (not an unpacked sdist)."""
    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True
    )
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT


def checkout_state(root=ROOT):
    """What ``git status`` sees in the checkout at ``root``: each modified, deleted or
    untracked (not ignored) path, with the SHA-256 of its content (``None`` when gone)."""
    status = subprocess.run(
        ["git", "status", "--porcelain=v1", "-z", "--untracked-files=all"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode("utf-8")
    state, entries = {}, iter(status.split("\0"))
    for entry in entries:
        if not entry:
            continue
        code, name = entry[:2], entry[3:]
        if code[0] in "RC":
            next(entries)  # a rename or copy: its source path follows
        file = root / name
        digest = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None
        state[name] = (code, digest)
    return state


def _changed(before, after):
    """The paths whose ``checkout_state`` differs between ``before`` and ``after``."""
    return sorted(
        path for path in before.keys() | after.keys() if before.get(path) != after.get(path)
    )


def guide_arguments(path, runs):
    """The arguments of ``docs/hooks/guides.py`` that run the guide at ``path`` as the tests
    do: its run goes to ``runs/<name>/``, outside the checkout."""
    return ["--runs", str(runs), str(path)]


def _words(output):
    """A guide's printed output without its numbers: what no machine changes."""
    return re.sub(r"[-+]?\d[\d.,e+-]*", "#", output)


@pytest.mark.parametrize("name", NAMES)
def test_guide_runs_and_saves_the_figures_it_shows(name, tmp_path):
    """Run the guide as CI does, into a temporary folder: it must save exactly the figures
    its Markdown embeds, those of its committed run, and leave the checkout as it was."""
    path = ROOT / "docs" / "guides" / f"{name}.py"
    needs = OPTIONAL.get(name)
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{name} needs {needs} (the extra calib_lightning[{needs}])")
    work, runs = tmp_path / "work", tmp_path / "runs"
    work.mkdir()
    before = checkout_state() if _git_checkout() else None
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "docs/hooks/guides.py"), *guide_arguments(path, runs)],
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, f"{name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    if before is not None:
        changed = _changed(before, checkout_state())
        assert not changed, f"running {name} changed the checkout: {changed}"
    record = hook.load_run(name, runs)
    assert record["script_sha256"] == hook.script_hash(path)
    assert record["figures"], f"{name} saved no figure under figures/"
    assert sorted(record["figures"]) == sorted(set(hook.figure_links(_markdown(path))))
    for figure in record["figures"]:
        assert (runs / name / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure
    code_cells = [c for c in hook.cells(path.read_text("utf-8")) if c.kind == "code"]
    assert len(record["outputs"]) == len(code_cells)
    assert any(output.strip() for output in record["outputs"]), f"{name} printed nothing"
    assert not list(work.iterdir()), "a guide wrote outside its temporary folder"
    # the committed run, which the site shows, is one of this text and saves these figures
    committed = hook.load_run(name)
    assert committed is not None, f"{name} has never run: no docs/guides/runs/{name}/run.json"
    assert committed["script_sha256"] == record["script_sha256"], f"{name} changed since its run"
    assert committed["figures"] == record["figures"]
    # its printed words may still be of an older package (a reworded verdict): said, not
    # failed, since another machine's numbers can move a borderline phrase
    for cell, (old, new) in enumerate(zip(committed["outputs"], record["outputs"], strict=True)):
        if _words(old) != _words(new):
            warnings.warn(
                f"{name}: code cell {cell + 1} prints other words than its committed run; "
                f"refresh it: python docs/hooks/guides.py docs/guides/{name}.py",
                stacklevel=1,
            )
            break


def test_running_a_guide_as_the_tests_do_leaves_the_checkout_as_it_was(tmp_path, monkeypatch):
    """The command the tests run a guide with writes its run to the folder it is given:
    the committed runs, the guides and every other file of the checkout stay as they were."""
    if not _git_checkout():
        pytest.skip("not a git checkout: no git status to compare")
    guide = tmp_path / "tiny_guide.py"
    guide.write_text(
        "# %% [markdown]\n# # Tiny\n\n# %%\nimport pathlib\n\nimport matplotlib.pyplot as plt\n\n"
        "pathlib.Path('figures').mkdir()\nplt.plot([0, 1])\nplt.savefig('figures/line.png')\n"
        "print('ran')\n\n# %% [markdown]\n# ![a line](figures/line.png)\n",
        encoding="utf-8",
    )
    runs = tmp_path / "runs"
    monkeypatch.setattr(sys, "path", [*sys.path])
    threads = torch.get_num_threads()
    before = checkout_state()
    try:
        hook.main(guide_arguments(guide, runs))
    finally:
        torch.set_num_threads(threads)
    assert not _changed(before, checkout_state())
    assert not (hook.RUNS / "tiny_guide").exists()
    record = hook.load_run("tiny_guide", runs)
    assert record["outputs"] == ["ran\n"]
    assert record["figures"] == ["line.png"]
    assert (runs / "tiny_guide" / "line.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkout_state_sees_edits_new_files_and_deletions(tmp_path):
    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )

    git("init", "-q")
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name, encoding="utf-8")
    (tmp_path / ".gitignore").write_text("ignored/\n", encoding="utf-8")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    assert checkout_state(tmp_path) == {}
    (tmp_path / "a.txt").write_text("edited", encoding="utf-8")
    edited = checkout_state(tmp_path)
    assert set(edited) == {"a.txt"}
    assert edited["a.txt"][0] == " M"
    (tmp_path / "a.txt").write_text("edited again", encoding="utf-8")
    assert checkout_state(tmp_path) != edited  # a second edit of a modified file shows
    (tmp_path / "b.txt").unlink()
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "c.txt").write_text("c", encoding="utf-8")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "d.txt").write_text("d", encoding="utf-8")
    state = checkout_state(tmp_path)
    assert state["b.txt"] == (" D", None)
    assert state["new/c.txt"][0] == "??"
    assert "ignored/d.txt" not in state


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
