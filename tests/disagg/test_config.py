"""Flags and the transfer handle (no model, no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recap import cli
from recap.core.transfer import RemoteOffer
from recap.disagg.config import KVTransferConfig, RemoteHandle, proxy_kv_api_key, transfer_config
from recap.disagg.proxy import ProxyConfig

HANDLE = RemoteHandle("tcp://127.0.0.1:5555", "cmpl-1-0#0", 16, RemoteOffer(40, 7, (16, 32), "ab" * 16),
                      1.7e9, "c" * 64)


def test_handle_round_trips_through_params() -> None:
    params = {**HANDLE.to_params(), "do_remote_prefill": True}
    assert RemoteHandle.from_params(params) == HANDLE
    windowed = RemoteHandle(HANDLE.address, HANDLE.transfer_id, 16, RemoteOffer(40, 7, (16, 32), "ab" * 16, 1),
                            1.7e9, "c" * 64)
    assert windowed.to_params()["window_start"] == 1
    assert RemoteHandle.from_params({**windowed.to_params(), "do_remote_prefill": True}) == windowed


@pytest.mark.parametrize(("change", "words"), [
    ({"do_remote_prefill": False}, "do_remote_prefill"),
    ({"remote_address": "http://x:1"}, "remote_address"),
    ({"remote_address": "ray://app/deployment"}, "remote_address"),  # a Ray address names one replica
    ({"remote_address": "ray://app/dep/replica/x"}, "remote_address"),
    ({"num_prompt_tokens": -1}, "num_prompt_tokens"),
    ({"first_token_id": "7"}, "first_token_id"),
    ({"checkpoint_positions": [0]}, "checkpoint_positions"),
    ({"prompt_digest": "xyz"}, "prompt_digest"),
    ({"window_start": -1}, "window_start"),
    ({"window_start": True}, "window_start"),
    ({"mac": "c" * 63}, "mac"),
    ({"expires_at": float("nan")}, "expires_at"),
    ({"surprise": 1}, "unknown field"),
])
def test_bad_handles_name_the_field(change: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        RemoteHandle.from_params({**HANDLE.to_params(), "do_remote_prefill": True, **change})


def test_a_handle_without_window_start_is_refused() -> None:
    """Null says the model has no window layers; a missing field is an older or foreign prefill side."""
    params = {**HANDLE.to_params(), "do_remote_prefill": True}
    del params["window_start"]
    with pytest.raises(ValueError, match="window_start"):
        RemoteHandle.from_params(params)


def test_ray_addresses() -> None:
    """A handle may name a Ray prefill replica; a decode side's peer may be a Ray prefill deployment."""
    params = {**HANDLE.to_params(), "remote_address": "ray://recap/RecapPrefill/x1y2", "do_remote_prefill": True}
    assert RemoteHandle.from_params(params).address == "ray://recap/RecapPrefill/x1y2"
    secret = b"s" * 16
    assert KVTransferConfig(role="decode", secret=secret, peers=("ray://recap/RecapPrefill",)).peers
    with pytest.raises(ValueError, match="peers"):
        KVTransferConfig(role="decode", secret=secret, peers=("ray://recap/RecapPrefill/x1y2",))


def test_serve_role_flags_build_the_transfer_config() -> None:
    args = cli.build_parser().parse_args(["serve", "--role", "decode", "--kv-transfer-timeout", "5",
                                          "--fallback-local-prefill", "--kv-secret", "s" * 16,
                                          "--kv-peer", "tcp://127.0.0.1:5555"])
    assert transfer_config(args) == KVTransferConfig(role="decode", transfer_timeout_s=5.0,
                                                     fallback_local_prefill=True, secret=b"s" * 16,
                                                     peers=("tcp://127.0.0.1:5555",))
    assert transfer_config(cli.build_parser().parse_args(["serve"])).role == "both"
    with pytest.raises(ValueError, match="hold_timeout_s"):
        transfer_config(cli.build_parser().parse_args(["serve", "--kv-hold-timeout", "0"]))


def test_proxy_flags() -> None:
    args = cli.build_parser().parse_args(["proxy", "--prefill", "http://a:1", "--prefill", "http://b:2",
                                          "--decode", "http://c:3", "--port", "9000"])
    assert (args.prefill, args.decode, args.port) == (["http://a:1", "http://b:2"], ["http://c:3"], 9000)
    with pytest.raises(ValueError, match="http"):
        ProxyConfig(("a:1",), ("http://c:3",))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["proxy", "--decode", "http://c:3"])


def test_hold_flags_and_the_front_end_credential(tmp_path: Path) -> None:
    """The prefill side's credential is --kv-api-key or derived from the secret; the proxy derives the same
    from the same secret file, and refuses to start with neither."""
    path = str(tmp_path / "kv.secret")
    prefill = transfer_config(cli.build_parser().parse_args([
        "serve", "--role", "prefill", "--kv-secret-file", path, "--kv-accept-timeout", "3", "--kv-max-holds", "6",
        "--kv-max-holds-per-client", "2"]))
    assert (prefill.accept_timeout_s, prefill.max_holds, prefill.max_holds_per_client) == (3.0, 6, 2)
    assert len(prefill.kv_api_key) == 64 and prefill.kv_api_key.encode() not in prefill.secret
    proxy = ["proxy", "--prefill", "http://a:1", "--decode", "http://c:3"]
    assert proxy_kv_api_key(cli.build_parser().parse_args([*proxy, "--kv-secret-file", path])) == prefill.kv_api_key
    with pytest.raises(ValueError, match="--kv-secret-file"):
        proxy_kv_api_key(cli.build_parser().parse_args(proxy))
    keyed = ["--kv-api-key", "front-end-key"]
    assert transfer_config(cli.build_parser().parse_args([
        "serve", "--role", "prefill", "--kv-secret-file", path, *keyed])).kv_api_key == "front-end-key"
    assert proxy_kv_api_key(cli.build_parser().parse_args([*proxy, *keyed])) == "front-end-key"
    with pytest.raises(ValueError, match="accept_timeout_s"):
        transfer_config(cli.build_parser().parse_args(["serve", "--kv-accept-timeout", "0"]))


def test_prefill_and_decode_roles_need_a_secret_and_decode_needs_its_peers(tmp_path: Path) -> None:
    def config(*flags: str) -> KVTransferConfig:
        return transfer_config(cli.build_parser().parse_args(["serve", *flags]))

    with pytest.raises(ValueError, match="secret"):
        config("--role", "prefill")
    with pytest.raises(ValueError, match="secret"):
        config("--role", "prefill", "--kv-secret", "short")
    with pytest.raises(ValueError, match="peers"):
        config("--role", "decode", "--kv-secret", "s" * 16)
    with pytest.raises(ValueError, match="peers"):
        config("--role", "decode", "--kv-secret", "s" * 16, "--kv-peer", "http://x:1")
    # The secret file is created on first use (mode 0600) and read by the next instance.
    path = tmp_path / "kv.secret"
    first = config("--role", "prefill", "--kv-secret-file", str(path))
    second = config("--role", "decode", "--kv-secret-file", str(path), "--kv-peer", "tcp://127.0.0.1:1")
    assert first.secret == second.secret and len(first.secret) == 64
    assert path.stat().st_mode & 0o777 == 0o600
    assert config("--kv-secret-file", str(tmp_path / "unused")).secret == b""  # role both needs none
    assert not (tmp_path / "unused").exists()
