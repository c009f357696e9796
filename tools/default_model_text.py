"""Plain text out of the formats the default model's data packages ship (tools/default_model_data.py).

- `sword_blocks` / `osis_to_text`: SWORD Bible-software modules (Debian's sword-* packages). A zText/zCom
  module is a block index (`ot.bzs`/`nt.czs`: per block its offset, compressed and plain size, 3 x uint32 LE)
  over zlib-compressed blocks (`ot.bzz`/`nt.czz`); each block holds one book (or chapter) of OSIS XML.
- `html_to_text`: the prose of an HTML documentation page (Sphinx, DocBook and hand-written pages), without
  code blocks, navigation and index fragments.
- `deb_members`: the files of a Debian package's data archive, read in Python (no dpkg needed).
"""

from __future__ import annotations

import html
import io
import re
import struct
import tarfile
import zlib
from collections.abc import Iterator
from html.parser import HTMLParser

MIN_WORDS = 5  # an HTML text block shorter than this is navigation, a heading, a table cell or an index entry

_OSIS_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)  # footnotes and cross-references: not running text
_OSIS_BREAK = re.compile(r"<(?:chapter|div|title|/title|lb|l|/l|lg|/lg|row|item|p|/p)\b[^>]*>")
_TAG = re.compile(r"<[^>]*>")
_SPACES = re.compile(r"[ \t\r\f\v\u00a0]+")
_SPACE_BEFORE_PUNCT = re.compile(r" +([,.;:!?’”])")


def sword_blocks(index: bytes, data: bytes) -> list[str]:
    """The decompressed blocks of a SWORD zText/zCom testament, in index order (empty slots skipped)."""
    if len(index) % 12:
        raise ValueError(f"SWORD block index of {len(index)} bytes is not a multiple of 12")
    out = []
    for off, size, plain in struct.iter_unpack("<III", index):
        if size == 0:
            continue
        block = zlib.decompress(data[off : off + size])
        if len(block) != plain:
            raise ValueError(f"SWORD block at {off}: {len(block)} bytes, index says {plain}")
        out.append(block.decode("utf-8"))
    return out


def _tidy(lines: list[str], min_words: int) -> str:
    """Whitespace collapsed in each line, lines of fewer than `min_words` words dropped, joined by newlines."""
    kept = []
    for line in lines:
        line = _SPACES.sub(" ", line).strip()
        if len(line.split()) >= min_words:
            kept.append(line)
    return "\n".join(kept)


def osis_to_text(osis: str) -> str:
    """Running text of an OSIS fragment: notes dropped, paragraph/line/chapter/title tags as line breaks,
    every other tag (Strong's-number words, emphasis, references, divine names) reduced to its text."""
    text = _OSIS_NOTE.sub("", osis)
    text = _OSIS_BREAK.sub("\n", text)
    text = html.unescape(_TAG.sub("", text))
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", _SPACES.sub(" ", text))  # a removed tag had left "word ,"
    return _tidy(text.split("\n"), 1)


class _Prose(HTMLParser):
    """Collects the text of an HTML page, skipping code, navigation and boilerplate subtrees."""

    SKIP_TAGS = frozenset({"head", "script", "style", "pre", "nav", "footer", "form", "noscript", "svg"})
    SKIP_CLASSES = frozenset({"related", "sphinxsidebar", "footer", "navheader", "navfooter", "headerlink",
                              "highlight", "toc", "menu", "breadcrumbs", "sidebar", "toctree-wrapper",
                              "programlisting", "screen", "synopsis", "cmdsynopsis", "mobile-nav"})  # fmt: skip
    VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
                      "track", "wbr", "param"})  # fmt: skip
    BREAKS = frozenset({"p", "div", "li", "dd", "dt", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "br",
                        "blockquote", "section", "table", "ul", "ol", "td", "th", "hr", "dl", "caption"})  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip_tag: str | None = None  # the tag whose subtree is being skipped
        self._skip_depth = 0

    def _skips(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        if tag in self.SKIP_TAGS:
            return True
        a = dict(attrs)
        classes = set((a.get("class") or "").split())
        return bool(classes & self.SKIP_CLASSES) or a.get("role") == "navigation"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is not None:
            self._skip_depth += tag == self._skip_tag
            return
        if tag in self.BREAKS:
            self.parts.append("\n")
        if tag not in self.VOID and self._skips(tag, attrs):  # a void element has no end tag to stop at
            self._skip_tag, self._skip_depth = tag, 1

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is None and tag in self.BREAKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self._skip_tag is not None:
            self._skip_depth -= tag == self._skip_tag
            if self._skip_depth == 0:
                self._skip_tag = None
        elif tag in self.BREAKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._skip_tag is None:
            self.parts.append(data.replace("\n", " "))


def html_to_text(page: str, min_words: int = MIN_WORDS) -> str:
    """The prose of an HTML page: one line per block element, blocks under `min_words` words dropped."""
    parser = _Prose()
    parser.feed(page)
    parser.close()
    text = "".join(parser.parts).replace("\u00b6", "")  # Sphinx's permalink pilcrows
    return _tidy(text.split("\n"), min_words)


def _ar_members(deb: bytes) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each member of an `ar` archive (the container of a .deb)."""
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not a Debian package (no ar magic)")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        yield name, deb[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are 2-byte aligned


def deb_members(deb: bytes, prefix: str) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of each regular file under `prefix` (e.g. "usr/share/doc/") in a .deb's data archive."""
    for name, body in _ar_members(deb):
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:  # xz or gz: tarfile detects it
                for m in tar.getmembers():
                    path = m.name.removeprefix("./")
                    if m.isfile() and path.startswith(prefix):
                        f = tar.extractfile(m)
                        assert f is not None
                        yield path, f.read()
            return
    raise ValueError("Debian package without a data.tar member")
