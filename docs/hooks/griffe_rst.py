"""Griffe extension: read the package's docstrings' reST markup as Markdown.

The docstrings are Google style with a little reST inside (zuko's habit), which reads
well in ``help()`` and in an editor: ``:math:`x```, ``.. math::`` blocks, cross-reference
roles such as ``:func:`~calib_lightning.functional.rank_ecdf```, and ``Example:``
sections of doctests. mkdocstrings renders docstrings as Markdown, so before it parses
them this extension rewrites, in the rendered copy only:

- ``:math:`x``` to ``$x$`` and a ``.. math::`` block to a ``$$`` block (MathJax typesets
  both through ``pymdownx.arithmatex``);
- ``:role:`~a.b.c``` to ```c```, ``:role:`a.b.c``` to ```a.b.c``` and
  ``:role:`text <a.b>``` to ```text``` (code, not links: many targets are relative);
- an ``Example:`` section title to ``Examples:``, the title griffe's Google parser reads
  as doctests;
- the entries of a ``References:`` section, one paper after another on the following
  lines, to a list: an entry starts where a line begins with ``Surname,`` after a line
  that ends a sentence.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_MATH = re.compile(r":math:`([^`]+)`")
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]+?)(?:\s*<[^`>]+>)?`")
_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_MATH_BLOCK = re.compile(r"^(\s*)\.\. math::[ \t]*(.*)$")
_REFERENCES = re.compile(r"^(\s*)References:\s*$")
_AUTHOR = re.compile(r"^[A-Z][\w'-]*,")


def _role(match: re.Match[str]) -> str:
    text = match.group(2).strip()
    if match.group(1):  # ~a.b.c: show the last part
        text = text.rsplit(".", 1)[-1]
    return f"`{text}`"


def _math_blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _MATH_BLOCK.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group(1)
        body = [match.group(2)] if match.group(2) else []
        i += 1
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)
        ):
            body.append(lines[i].strip())
            i += 1
        while body and not body[-1]:
            body.pop()
            i -= 1  # give the trailing blank lines back to the text
        out += [f"{indent}$$", *(f"{indent}{b}" for b in body if b), f"{indent}$$"]
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _references(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        match = _REFERENCES.match(lines[i])
        i += 1
        if match is None:
            continue
        entries: list[list[str]] = []
        body_indent = None
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) > len(match.group(1)):
            line = lines[i].strip()
            body_indent = body_indent or " " * _indent(lines[i])
            starts = not entries or (entries[-1][-1].endswith(".") and _AUTHOR.match(line))
            if starts:
                entries.append([line])
            else:
                entries[-1].append(line)
            i += 1
        out += [f"{body_indent}- {' '.join(entry)}" for entry in entries]
    return "\n".join(out)


def to_markdown(text: str) -> str:
    """The docstring ``text`` with its reST markup rewritten as Markdown (module doc)."""
    text = _references(_math_blocks(text))
    text = _MATH.sub(lambda m: f"${m.group(1).strip()}$", text)
    text = _ROLE.sub(_role, text)
    return _EXAMPLE.sub(r"\1Examples:", text)


class RestructuredTextToMarkdown(griffe.Extension):
    """Rewrite every docstring griffe loads with :func:`to_markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
