"""recap.disagg.trust without processes: tags bind a handle to its prompt, its peer, its lifetime, one use."""

from __future__ import annotations

import pytest

from recap.core.transfer import RemoteOffer
from recap.disagg.config import RemoteHandle
from recap.disagg.trust import HandleRefused, HandleVerifier, prompt_fingerprint, sign

SECRET = b"a-deployment-secret-of-some-length"
PEER = "tcp://127.0.0.1:5555"
TOKENS = list(range(3, 43))
NOW = 1_000_000.0


def signed(address: str = PEER, secret: bytes = SECRET, tokens: list[int] = TOKENS, salt: str | None = None,
           expires_at: float = NOW + 60) -> RemoteHandle:
    handle = RemoteHandle(address, "cmpl-1-0", 16, RemoteOffer(len(tokens), 7, (16, 32), "ab" * 16), expires_at)
    return RemoteHandle(**{**handle.__dict__, "mac": sign(secret, handle.signed_fields(),
                                                          prompt_fingerprint(tokens, salt))})


def verifier(clock: list[float]) -> HandleVerifier:
    return HandleVerifier(SECRET, [PEER], clock=lambda: clock[0])


def check(v: HandleVerifier, h: RemoteHandle, tokens: list[int] = TOKENS, salt: str | None = None) -> None:
    v.verify(h.signed_fields(), h.mac, tokens, salt)


def test_a_peer_handle_passes_once() -> None:
    v = verifier([NOW])
    check(v, signed())
    with pytest.raises(HandleRefused, match="replay"):
        check(v, signed())
    assert v.num_refused == 1


@pytest.mark.parametrize(("handle", "tokens", "salt", "words"), [
    (signed(address="tcp://10.0.0.9:5555"), TOKENS, None, "not a prefill peer"),
    (signed(secret=b"another-deployments-secret!"), TOKENS, None, "does not verify"),
    (signed(), TOKENS[:-1] + [99], None, "does not verify"),  # issued for another prompt
    (signed(), TOKENS, "tenant-b", "does not verify"),  # ... or another cache salt
    (signed(expires_at=NOW - 1), TOKENS, None, "expired"),
    (signed(expires_at=NOW + 10**6), TOKENS, None, "too far"),
])
def test_foreign_forged_or_stale_handles_are_refused(handle: RemoteHandle, tokens: list[int], salt: str | None,
                                                     words: str) -> None:
    with pytest.raises(HandleRefused, match=words):
        check(verifier([NOW]), handle, tokens, salt)


def test_an_altered_field_breaks_the_tag() -> None:
    h = signed()
    fields = {**h.signed_fields(), "first_token_id": 8}
    with pytest.raises(HandleRefused, match="does not verify"):
        verifier([NOW]).verify(fields, h.mac, TOKENS, None)


def test_used_tags_are_forgotten_after_they_expire() -> None:
    clock = [NOW]
    v = verifier(clock)
    check(v, signed(expires_at=NOW + 5))
    clock[0] = NOW + 6
    check(v, signed(expires_at=NOW + 60))  # pruning happens here
    assert len(v._used) == 1


def test_a_ray_peer_deployment_admits_its_replicas_only() -> None:
    """On Ray (recap.cluster.ray_transport) the decode side's peer is the prefill deployment."""
    v = HandleVerifier(SECRET, ["ray://recap/RecapPrefill"], clock=lambda: NOW)
    assert v.is_peer("ray://recap/RecapPrefill/abc123")
    assert not v.is_peer("ray://recap/RecapDecode/abc123")
    assert not v.is_peer("ray://other/RecapPrefill/abc123")
    assert not v.is_peer("tcp://127.0.0.1:5555") and not v.is_peer(None)
    check(v, signed(address="ray://recap/RecapPrefill/abc123"))
    with pytest.raises(HandleRefused, match="not a prefill peer"):
        check(v, signed(address="ray://recap/Elsewhere/abc123"))
