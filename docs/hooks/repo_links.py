"""MkDocs hook: put the repository files the pages link to on the site, and check them.

The Markdown in ``docs/`` is written to be read on GitHub too, so it links to files
outside ``docs/``: the README, ``examples/benchmarks/README.md``, the result tables
under ``examples/benchmarks/results/``, the scripts. MkDocs only knows ``docs/``, and
``--strict`` would reject those links. This hook follows the links from every page,
transitively, adds each linked repository file to the site (Markdown files as pages,
anything else copied as is), and rewrites the links to the site's paths. A link to a
file that does not exist is left alone, so ``mkdocs build --strict`` still fails on it.

Site paths: ``docs/X`` is ``X``; the files in ``_PAGES`` get a short name
(``examples/benchmarks/README.md`` is the benchmarks page); any other file keeps its
path in the repository (``examples/benchmarks/results/tarp_vs_sbi.md``).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_ROOT = Path(__file__).resolve().parents[2]
_PAGES = {
    "README.md": "readme.md",
    "CHANGELOG.md": "changelog.md",
    "CONTRIBUTING.md": "contributing.md",
    "examples/benchmarks/README.md": "benchmarks.md",
}
# Inline links and images `](target "title")`, and reference definitions `[x]: target`.
_INLINE = re.compile(r"(\]\(\s*<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\s*\))")
_REFERENCE = re.compile(r"^(\s{0,3}\[[^\]]+\]:\s*<?)(\S+?)(>?(?:\s.*)?)$", re.MULTILINE)
_FENCE = re.compile(r"^\s*(```|~~~)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_CODE_SPAN = re.compile(r"`[^`\n]*`")

# repository path (posix, relative to the root) -> site path, filled by on_files
_site_paths: dict[str, str] = {}


def _site_path(repo_path: str) -> str:
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return _PAGES.get(repo_path, repo_path)


def _outside_fences(markdown: str) -> list[tuple[bool, str]]:
    """Split Markdown into (is_prose, text) chunks; fenced code blocks are not prose."""
    chunks: list[tuple[bool, str]] = []
    prose, lines = True, []
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line):
            if prose:
                chunks.append((True, "".join(lines)))
                lines = [line]
            else:
                lines.append(line)
                chunks.append((False, "".join(lines)))
                lines = []
            prose = not prose
            continue
        lines.append(line)
    chunks.append((prose, "".join(lines)))
    return chunks


def _repo_target(source: Path, target: str) -> tuple[str, str] | None:
    """The repository path and anchor a relative link from ``source`` points to."""
    if not target or target.startswith("#") or _SCHEME.match(target):
        return None
    path, _, anchor = target.partition("#")
    resolved = (source.parent / path).resolve()
    if not resolved.is_file() or not resolved.is_relative_to(_ROOT):
        return None
    return resolved.relative_to(_ROOT).as_posix(), anchor


def _targets(source: Path) -> list[str]:
    markdown = source.read_text(encoding="utf-8")
    found = []
    for prose, text in _outside_fences(markdown):
        if prose:
            found += [m.group(2) for m in _INLINE.finditer(text)]
            found += [m.group(2) for m in _REFERENCE.finditer(text)]
    return found


def on_files(files: Files, config: Any) -> Files:
    """Add every repository file reachable by links from the pages in ``docs/``."""
    docs_dir = Path(config["docs_dir"]).resolve()
    queue = [Path(f.abs_src_path).resolve() for f in files if f.src_uri.endswith(".md")]
    # the pages named in _PAGES are on the site even when nothing links to them yet
    named = [(_ROOT / p).resolve() for p in _PAGES if (_ROOT / p).is_file()]
    for path in named:
        _add(files, config, path)
    queue += named
    seen = set(queue)
    while queue:
        source = queue.pop()
        for target in _targets(source):
            hit = _repo_target(source, target)
            if hit is None:
                continue
            path = (_ROOT / hit[0]).resolve()
            if path in seen or path.is_relative_to(docs_dir):
                continue
            seen.add(path)
            _add(files, config, path)
            if path.suffix == ".md":
                queue.append(path)
    return files


def _add(files: Files, config: Any, path: Path) -> None:
    repo_path = path.relative_to(_ROOT).as_posix()
    site_path = _site_path(repo_path)
    _site_paths[repo_path] = site_path
    if files.get_file_from_path(site_path) is None:
        files.append(File.generated(config, site_path, abs_src_path=str(path)))


def _table_pipes(text: str) -> str:
    """``\\|`` inside code spans on table rows as ``|``: GitHub needs the escape there,
    Python-Markdown's tables do not split cells at a code span's pipe and would show it."""

    def unescape(match: re.Match[str]) -> str:
        return match.group(0).replace("\\|", "|")

    return "\n".join(
        _CODE_SPAN.sub(unescape, line) if line.lstrip().startswith("|") else line
        for line in text.split("\n")
    )


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite links to repository files into links to their pages on the site, and
    unescape the pipes of code spans in tables (:func:`_table_pipes`)."""
    source = Path(page.file.abs_src_path)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        hit = _repo_target(source, match.group(2))
        if hit is None:
            return match.group(0)
        repo_path, anchor = hit
        site_path = _site_paths.get(repo_path, _site_path(repo_path))
        target = posixpath.relpath(site_path, here or ".")
        if anchor:
            target += "#" + anchor
        return match.group(1) + target + match.group(3)

    out = []
    for prose, text in _outside_fences(markdown):
        if prose:
            text = _table_pipes(_REFERENCE.sub(rewrite, _INLINE.sub(rewrite, text)))
        out.append(text)
    return "".join(out)
