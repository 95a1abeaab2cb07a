"""The Python standard library as two corpora that every Python install carries: code, and its documentation prose.

The main job pre-trains a base model on one and fine-tunes it on the other, a shift of distribution that needs no
download:

- ``"code"``: the ``.py`` sources with their docstrings removed (comments kept);
- ``"docs"``: the docstrings of those sources, plus the language reference text that Python ships in
  ``pydoc_data.topics``, spread evenly among them so that the tail of the corpus (a validation split) holds both.

The two share no docstring text: a docstring is either left in the code (rare: one that shares a line with code, like
``def f(): "doc"``) or moved to the docs.
"""

from __future__ import annotations

import ast
import contextlib
import pathlib
from collections.abc import Iterator
from typing import Literal

StdlibText = Literal["source", "code", "docs"]
"""Which text of the standard library a corpus holds: the sources whole, the code without docstrings, the docs."""

STDLIB_TEXTS: tuple[str, ...] = ("source", "code", "docs")


def split_docstrings(source: str) -> tuple[str, list[str]]:
    """``(the code without its docstrings, the docstrings)`` of a Python source.

    Raises:
        SyntaxError: ``source`` is not Python that this interpreter parses.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    removed: set[int] = set()
    docstrings = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        text = ast.get_docstring(node, clean=True)
        if not text:
            continue
        docstrings.append(text)
        expr = node.body[0]
        first, last = expr.lineno - 1, (expr.end_lineno or expr.lineno) - 1
        end_col = expr.end_col_offset if expr.end_col_offset is not None else len(lines[last])
        alone = not lines[first][: expr.col_offset].strip() and not lines[last][end_col:].strip()
        if alone:
            removed.update(range(first, last + 1))
    code = "".join(line for index, line in enumerate(lines) if index not in removed)
    return code, docstrings


def _reference_topics() -> list[str]:
    """The language reference text of ``pydoc_data.topics``, sorted by topic name; empty where Python lacks it."""
    with contextlib.suppress(ImportError):  # some slim Pythons ship without pydoc_data
        from pydoc_data.topics import topics

        return [topics[name] for name in sorted(topics)]
    return []


def stdlib_documents(files: list[pathlib.Path], text: StdlibText) -> Iterator[bytes]:
    """The documents of one corpus, in a fixed order: one per source file (``"source"``, ``"code"``), or one per file
    with docstrings and one per reference topic (``"docs"``). Files that are not UTF-8 Python are skipped.

    Documents are produced lazily, so a reader that stops at a byte budget parses only the files it needs.
    """
    topics = _reference_topics() if text == "docs" else []
    next_topic = 0
    for index, path in enumerate(files):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text == "source":
            yield source.encode()
            continue
        try:
            code, docstrings = split_docstrings(source)
        except (SyntaxError, ValueError):  # a file for another Python version, or one with NUL bytes
            continue
        if text == "code":
            yield code.encode()
            continue
        if docstrings:
            yield "\n\n".join(docstrings).encode()
        # topic t goes after file floor(t * files / topics): the reference is spread evenly over the docstrings
        while next_topic < len(topics) and next_topic * len(files) <= index * len(topics):
            yield topics[next_topic].encode()
            next_topic += 1
    for topic in topics[next_topic:]:
        yield topic.encode()
