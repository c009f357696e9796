"""Trust between the instances of one disaggregated deployment (docs/disaggregation.md, "Trust"). Torch-free.

A decode instance connects to the address a transfer handle names and registers what it receives in its
prefix cache, so it takes handles only from its own prefill peers:
  - the prefill side signs each handle: HMAC-SHA256 under the deployment's shared secret over the handle's
    fields (address, transfer id, prompt digest, checkpoint positions, expiry ...) and a SHA-256 of the
    prompt itself (cache salt and token ids);
  - the decode side checks, before anything is queued and before any connection: the address is one of
    its configured peers (`--kv-peer`; on Ray, `ray://app/deployment` admits that deployment's replicas,
    `ray://app/deployment/replica`), the tag verifies against the prompt *it* tokenized, the handle
    has not expired, and it was never used before (replay);
  - the prefill side's transfer server sends a held request's data only to a pull carrying its tag.
Received blocks and checkpoints are registered under the hashes the decode side computes from its own
prompt (recap.core.transfer); the tag proves the data came from a peer that computed that same prompt.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import os
import secrets
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SECRET_MIN_BYTES = 16
MAX_LIFETIME_S = 3600.0  # a handle valid for longer is refused (it bounds the replay memory)


class HandleRefused(ValueError):
    """A transfer handle this decode instance does not trust; the message says why."""


def parse_secret(text: str) -> bytes:
    """The secret as given on a flag or in a file (surrounding whitespace ignored)."""
    raw = text.strip().encode()
    if len(raw) < SECRET_MIN_BYTES:
        raise ValueError(f"the KV transfer secret must have at least {SECRET_MIN_BYTES} characters")
    return raw


def load_or_create_secret(path: Path) -> bytes:
    """Read the deployment's secret from `path`; when it does not exist yet, create it (mode 0600) with a
    fresh random secret. Creation is atomic (link of a complete temp file), so instances started together
    agree on one secret."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (secrets.token_hex(32) + "\n").encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another instance created it first: then read theirs
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return parse_secret(path.read_text())


def derive_api_key(secret: bytes) -> str:
    """The credential a prefill instance asks of `do_remote_decode` requests when no --kv-api-key is given:
    derived from the deployment's secret, so a front end holding the secret file holds it too (and a leak
    of this key reveals nothing that signs handles)."""
    return hmac.new(secret, b"recap kv api key", hashlib.sha256).hexdigest()


def prompt_fingerprint(token_ids: Sequence[int], cache_salt: str | None) -> bytes:
    """SHA-256 of (cache salt, token ids): what the tag binds the handle to."""
    h = hashlib.sha256()
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8", "surrogatepass")
    h.update(len(salt).to_bytes(8, "little") + salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def sign(secret: bytes, fields: dict[str, Any], fingerprint: bytes) -> str:
    """The tag of a handle's fields (everything but the tag) and the prompt fingerprint."""
    message = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode() + b"\0" + fingerprint
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class HandleVerifier:
    """The decode side's check of every handle; remembers used tags until they expire. Thread-safe."""

    def __init__(self, secret: bytes, peers: Sequence[str], clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self.peers = frozenset(peers)
        self._clock = clock
        self._lock = threading.Lock()
        self._used: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, tag)
        self.num_refused = 0

    def verify(self, fields: dict[str, Any], tag: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Raise HandleRefused unless the handle comes from a peer, for this prompt, unexpired, unused;
        then mark it used (a second request with the same handle is a replay)."""
        try:
            self._check(fields, tag, token_ids, cache_salt)
        except HandleRefused:
            with self._lock:
                self.num_refused += 1
            raise

    def is_peer(self, address: object) -> bool:
        """A configured peer, or (Ray) a replica of a configured peer deployment."""
        if not isinstance(address, str):
            return False
        return address in self.peers or (address.startswith("ray://") and address.rsplit("/", 1)[0] in self.peers)

    def _check(self, fields: dict[str, Any], tag: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        address = fields.get("remote_address")
        if not self.is_peer(address):
            raise HandleRefused(f"remote_address {address!r} is not a prefill peer of this instance (--kv-peer)")
        expected = sign(self._secret, fields, prompt_fingerprint(token_ids, cache_salt))
        if not hmac.compare_digest(expected, tag):
            raise HandleRefused("the handle's tag does not verify (not signed by a prefill peer of this deployment, "
                                "altered, or issued for another prompt)")
        now, expires_at = self._clock(), float(fields.get("expires_at", 0.0))
        if not now <= expires_at <= now + MAX_LIFETIME_S:
            raise HandleRefused("the handle has expired" if expires_at < now else "the handle's expiry is too far")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._used.discard(heapq.heappop(self._expiry)[1])
            if tag in self._used:
                raise HandleRefused("the handle was already used (replay)")
            self._used.add(tag)
            heapq.heappush(self._expiry, (expires_at, tag))
