"""Fine-tune text that a pretrained LLM rarely saw, read from what a Linux machine already holds (no download).

Each domain is a list of documents (strings) in a fixed order, the same on every run of the same machine:

- ``"man"``: the troff sources of the English manual pages, ``/usr/share/man/man*/*.gz`` (the language folders such
  as ``de/`` are not read; symbolic links and ``.so`` redirections are skipped; one page per document). At most
  ``MAX_FAMILY`` pages of one name family (the name up to its first ``-``, ``_`` or ``.``) are taken, so that a
  generated family, such as the thousands of ``gcloud_*`` pages of the Google Cloud SDK, does not make the domain.
- ``"changelog"``: the Debian changelogs of the installed packages, ``/usr/share/doc/*/changelog.Debian.gz`` (one
  package per document, newest entries first: log-like text of versions, bullet points, names and dates).

The files are taken in the order of the CRC-32 of their path relative to the root (a fixed shuffle that mixes the
sections and the alphabet, and that does not depend on which other files are installed), each cut to its first
``max_doc_chars`` characters, until ``max_chars`` characters are read. A domain whose files are absent raises
``DomainMissing`` with a line that names the folder and the package that provides it.
"""

from __future__ import annotations

import collections
import gzip
import pathlib
import re
import zlib
from collections.abc import Callable, Iterator

MAN_ROOT = pathlib.Path("/usr/share/man")
DOC_ROOT = pathlib.Path("/usr/share/doc")
MAX_CHARS = 6_000_000
"""Characters read per domain: about 2 M tokens of SmolLM2's tokenizer, far more than 450 steps of 4 x 64 tokens."""
MAX_FAMILY = 32
"""Man pages taken per name family (``git-*`` pages are one family, ``gcloud_*`` another)."""
MAX_DOC_CHARS = 32_768
"""Characters kept of one file (its beginning), so that a few long pages do not make most of a domain."""


class DomainMissing(RuntimeError):
    """The files a domain reads are not on this machine."""


def _ordered(root: pathlib.Path, files: list[pathlib.Path]) -> list[pathlib.Path]:
    return sorted(files, key=lambda path: (zlib.crc32(str(path.relative_to(root)).encode()), str(path)))


def man_page_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The gzip'd English man pages under ``root/man*/`` (``MAN_ROOT``), symbolic links excluded, in the domain's
    order."""
    root = MAN_ROOT if root is None else root
    files = [path for path in root.glob("man*/*.gz") if path.is_file() and not path.is_symlink()]
    return _ordered(root, files)


def changelog_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The ``changelog.Debian.gz`` of every package under ``root`` (``DOC_ROOT``), symbolic links excluded, in the
    domain's order."""
    root = DOC_ROOT if root is None else root
    files = [path for path in root.glob("*/changelog.Debian.gz") if path.is_file() and not path.is_symlink()]
    return _ordered(root, files)


def man_family(path: pathlib.Path) -> str:
    """A man page's name family: its file name up to the first ``-``, ``_`` or ``.``."""
    return re.split(r"[-_.]", path.name, maxsplit=1)[0]


def _read(path: pathlib.Path, max_doc_chars: int) -> str | None:
    try:
        with gzip.open(path, "rb") as stream:
            raw = stream.read(4 * max_doc_chars)
    except (OSError, EOFError, zlib.error):  # a truncated or not-gzip file: not part of the domain
        return None
    text = raw.decode("utf-8", errors="replace")[:max_doc_chars]
    return text if text.strip() else None


def _is_redirection(text: str) -> bool:
    """A man page that only points at another (``.so man1/other.1``), as ``man`` follows it."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith(('.\\"', "'\\\""))]
    return len(lines) <= 2 and any(line.startswith(".so ") for line in lines)


def _documents(
    files: list[pathlib.Path], keep: Callable[[str], bool], max_chars: int, max_doc_chars: int
) -> Iterator[str]:
    total = 0
    for path in files:
        if total >= max_chars:
            return
        text = _read(path, max_doc_chars)
        if text is None or not keep(text):
            continue
        total += len(text)
        yield text


def man_pages(
    root: pathlib.Path | None = None, max_chars: int = MAX_CHARS, max_doc_chars: int = MAX_DOC_CHARS
) -> list[str]:
    """The ``"man"`` domain: troff sources of the English man pages, one page per document."""
    root = MAN_ROOT if root is None else root
    files = man_page_files(root)
    if not files:
        raise DomainMissing(
            f"--domain man reads the English man pages' troff sources, {root}/man*/*.gz, and found none here; "
            "install them (Debian/Ubuntu: `apt-get install man-db manpages`; a minimized image also needs "
            "`unminimize`), or choose another --domain."
        )
    taken: collections.Counter[str] = collections.Counter()
    kept = []
    for path in files:
        taken[man_family(path)] += 1
        if taken[man_family(path)] <= MAX_FAMILY:
            kept.append(path)
    return list(_documents(kept, lambda text: not _is_redirection(text), max_chars, max_doc_chars))


def debian_changelogs(
    root: pathlib.Path | None = None, max_chars: int = MAX_CHARS, max_doc_chars: int = MAX_DOC_CHARS
) -> list[str]:
    """The ``"changelog"`` domain: the installed packages' Debian changelogs, one package per document."""
    root = DOC_ROOT if root is None else root
    files = changelog_files(root)
    if not files:
        raise DomainMissing(
            f"--domain changelog reads the Debian changelogs, {root}/*/changelog.Debian.gz, and found none here "
            "(a Debian or Ubuntu system keeps one per installed package unless the image strips /usr/share/doc); "
            "choose another --domain."
        )
    return list(_documents(files, lambda text: True, max_chars, max_doc_chars))


def listing_fingerprint(files: list[pathlib.Path]) -> str:
    """A short hex digest of the files' names and sizes: the key under which a domain's tokens are cached."""
    digest = 0
    for path in files:
        digest = zlib.crc32(f"{path}:{path.stat().st_size}\n".encode(), digest)
    return f"{digest:08x}"
