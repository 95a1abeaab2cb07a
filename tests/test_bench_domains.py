"""``benchmarks/domains.py``, the fine-tune texts of ``real_lm.py --domain``: which files each reads, in which order,
what it skips, and the error where they are absent. Built on small trees of gzip'd files in a temporary folder (no
download, the same on every machine); one test reads this machine's man pages where it has them. CPU, a second."""

from __future__ import annotations

import gzip
import pathlib
import sys
import zlib

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import domains  # noqa: E402


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as stream:
        stream.write(text)
    return path


def _man_tree(root: pathlib.Path) -> None:
    _write(root / "man1" / "ls.1.gz", '.\\" a comment\n.TH LS 1\n.SH NAME\nls \\- list directory contents\n')
    _write(root / "man1" / "cp.1.gz", ".TH CP 1\n.SH NAME\ncp \\- copy files\n")
    _write(root / "man3" / "printf.3.gz", ".TH PRINTF 3\n.SH NAME\nprintf \\- formatted output\n")
    _write(root / "man1" / "dir.1.gz", '.\\" redirected\n.so man1/ls.1\n')  # a redirection: skipped
    (root / "man1" / "vdir.1.gz").symlink_to("ls.1.gz")  # a link to a page already read: skipped
    _write(root / "de" / "man1" / "ls.1.gz", ".TH LS 1\n.SH BEZEICHNUNG\nls \\- Verzeichnisinhalte auflisten\n")
    for index in range(domains.MAX_FAMILY + 5):  # a generated family: only MAX_FAMILY of its pages are taken
        _write(root / "man1" / f"tool-sub{index}.1.gz", f".TH TOOL-SUB{index} 1\n.SH NAME\ntool sub{index}\n")


def test_man_pages_order_skips_and_family_cap(tmp_path: pathlib.Path) -> None:
    _man_tree(tmp_path)
    files = domains.man_page_files(tmp_path)
    relative = [str(path.relative_to(tmp_path)) for path in files]
    assert relative == sorted(relative, key=lambda name: zlib.crc32(name.encode())), "the CRC-32 order"
    assert "man1/vdir.1.gz" not in relative
    assert not any(name.startswith("de/") for name in relative)

    pages = domains.man_pages(tmp_path)
    assert not any("BEZEICHNUNG" in page for page in pages), "a language folder was read"
    assert not any(".so man1/ls.1" in page for page in pages), "a redirection was kept"
    assert sum("list directory contents" in page for page in pages) == 1, "ls is read once, not through its link"
    assert sum(".TH TOOL-SUB" in page for page in pages) == domains.MAX_FAMILY
    assert len(pages) == 3 + domains.MAX_FAMILY
    assert pages == domains.man_pages(tmp_path), "the same documents in the same order on every read"
    first = next(path for path in files if path.name != "dir.1.gz")
    with gzip.open(first, "rt") as stream:
        assert pages[0] == stream.read(), "the first page in the CRC-32 order comes first"


def test_budgets_cut_documents_and_the_domain(tmp_path: pathlib.Path) -> None:
    for name in ("alpha", "beta", "gamma", "delta"):
        _write(tmp_path / name / "changelog.Debian.gz", f"{name} (1.0-1) unstable; urgency=medium\n" + "x" * 500)
    everything = domains.debian_changelogs(tmp_path)
    assert len(everything) == 4
    assert all(len(doc) > 500 for doc in everything)
    assert [len(doc) for doc in domains.debian_changelogs(tmp_path, max_doc_chars=100)] == [100] * 4
    assert len(domains.debian_changelogs(tmp_path, max_chars=600)) == 2, "reading stops once the budget is met"
    assert domains.debian_changelogs(tmp_path)[0].startswith(
        domains.changelog_files(tmp_path)[0].parent.name + " (1.0-1)"
    )


def test_listing_fingerprint_follows_the_files(tmp_path: pathlib.Path) -> None:
    _man_tree(tmp_path)
    before = domains.listing_fingerprint(domains.man_page_files(tmp_path))
    assert before == domains.listing_fingerprint(domains.man_page_files(tmp_path))
    _write(tmp_path / "man8" / "mount.8.gz", ".TH MOUNT 8\n")
    assert domains.listing_fingerprint(domains.man_page_files(tmp_path)) != before, "a new page gives new tokens"


def test_missing_domain_names_what_is_missing(tmp_path: pathlib.Path) -> None:
    with pytest.raises(domains.DomainMissing, match=r"man\*/\*\.gz.*apt-get install man-db manpages"):
        domains.man_pages(tmp_path)
    with pytest.raises(domains.DomainMissing, match=r"changelog\.Debian\.gz"):
        domains.debian_changelogs(tmp_path)


def test_real_lm_stops_with_the_missing_domain(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``real_lm.py --domain man`` on a machine without man pages stops before loading anything, with the line."""
    pytest.importorskip("transformers")
    import real_lm

    monkeypatch.setattr(domains, "MAN_ROOT", tmp_path)
    with pytest.raises(SystemExit, match=r"^real_lm: --domain man reads the English man pages"):
        real_lm.main(["--quick", "--domain", "man", "--out", str(tmp_path / "out.json")])


@pytest.mark.skipif(not domains.man_page_files(), reason="this machine has no English man pages")
def test_this_machines_man_pages() -> None:
    pages = domains.man_pages(max_chars=200_000)
    assert sum(map(len, pages)) >= 200_000 - domains.MAX_DOC_CHARS
    assert all(len(page) <= domains.MAX_DOC_CHARS for page in pages)
    assert sum(".TH" in page or ".Dt" in page for page in pages) >= len(pages) // 2, "troff sources"
