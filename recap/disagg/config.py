"""Disaggregation configuration, the transfer handle, and the `recap serve` / `recap proxy` flags. Torch-free."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recap.core.transfer import RemoteOffer
from recap.disagg.trust import SECRET_MIN_BYTES, derive_api_key, load_or_create_secret, parse_secret

ROLES = ("both", "prefill", "decode")
_ADDRESS = re.compile(r"tcp://[A-Za-z0-9.\-\[\]:]+:\d+")
_RAY_NAME = r"[A-Za-z0-9_.\-]+"
_RAY_DEPLOYMENT = re.compile(rf"ray://{_RAY_NAME}/{_RAY_NAME}")  # a prefill deployment (recap.cluster.ray_transport)
_RAY_REPLICA = re.compile(rf"ray://{_RAY_NAME}/{_RAY_NAME}/{_RAY_NAME}")  # one of its replicas
_DIGEST = re.compile(r"[0-9a-f]{32}")
_TAG = re.compile(r"[0-9a-f]{64}")
_HANDLE_FIELDS = ("remote_address", "transfer_id", "block_size", "num_prompt_tokens", "first_token_id",
                  "checkpoint_positions", "prompt_digest", "window_start", "expires_at", "mac")


@dataclass(frozen=True)
class KVTransferConfig:
    """How an instance takes part in prefill/decode disaggregation (docs/disaggregation.md)."""

    role: str = "both"  # both: a single instance; prefill: computes prompts; decode: receives and decodes
    kv_host: str = "127.0.0.1"  # prefill: the interface the transfer server binds
    kv_port: int = 0  # prefill: the transfer server's port (0: any free port, reported in each handle)
    transfer_timeout_s: float = 30.0  # decode: a pull not complete by then fails its request (504)
    hold_timeout_s: float = 60.0  # prefill: held blocks nobody pulled by then are released
    # prefill: a hold no decode side accepted (verified its handle and queued it: it announces that) by then is
    # released; an accepted one waits for its pull up to hold_timeout_s.
    accept_timeout_s: float = 10.0
    # prefill: holds waiting for their pull at which new do_remote_decode requests are refused (429), of all
    # clients and of one client (its address); 0: half the engine's max_num_seqs, so held state slots leave
    # room for running requests.
    max_holds: int = 0
    max_holds_per_client: int = 0  # 0: max_holds (lower it when several front ends share one prefill instance)
    fallback_local_prefill: bool = False  # decode: on a failed transfer, prefill locally instead of failing
    send_delay_s: float = 0.0  # test hook: the prefill side waits this long before sending each transfer
    # Trust (recap.disagg.trust): the deployment's shared secret (prefill and decode), and the transfer server
    # addresses of the prefill peers a decode instance may pull from (it connects to nothing else).
    secret: bytes = field(default=b"", repr=False)
    peers: tuple[str, ...] = ()
    # prefill: the credential `do_remote_decode` requests must carry (header x-kv-api-key); "": derived from the
    # secret (recap.disagg.trust.derive_api_key), which `recap proxy --kv-secret-file` derives the same way.
    api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role != "both" and len(self.secret) < SECRET_MIN_BYTES:
            raise ValueError(f"secret: --role {self.role} needs the deployment's shared secret "
                             f"(--kv-secret-file or --kv-secret, at least {SECRET_MIN_BYTES} characters)")
        if self.role == "decode" and not self.peers:
            raise ValueError("peers: --role decode needs its prefill peers' transfer addresses (--kv-peer tcp://host:port)")
        for peer in self.peers:
            if not (_ADDRESS.fullmatch(peer) or _RAY_DEPLOYMENT.fullmatch(peer)):
                raise ValueError(f"peers: {peer!r} must look like tcp://host:port (or ray://app/deployment)")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port (0: any free port), got {self.kv_port}")
        for name in ("transfer_timeout_s", "hold_timeout_s", "accept_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.send_delay_s < 0:
            raise ValueError("send_delay_s must not be negative")
        if self.max_holds < 0 or self.max_holds_per_client < 0:
            raise ValueError("max_holds and max_holds_per_client must be >= 0 (0: the default)")

    @property
    def kv_api_key(self) -> str:
        """What a prefill instance asks of `do_remote_decode` requests."""
        return self.api_key or derive_api_key(self.secret)

    def hold_caps(self, max_num_seqs: int) -> tuple[int, int]:
        """(global, per client) caps on holds, defaults resolved against the engine's max_num_seqs."""
        total = self.max_holds or max(1, max_num_seqs // 2)
        return total, min(total, self.max_holds_per_client or total)


@dataclass(frozen=True)
class RemoteDecode:
    """Marks a prepared request for the prefill role: compute the prompt, sample one token, hold for a pull."""

    client: str = ""  # who asked (its address): the per-client cap on holds counts by it


@dataclass(frozen=True)
class RemoteHandle:
    """What the prefill side returns as `kv_transfer_params` and the decode side pulls with."""

    address: str  # the prefill side's transfer server, tcp://host:port (Ray: ray://app/deployment/replica)
    transfer_id: str
    block_size: int
    offer: RemoteOffer
    expires_at: float = 0.0  # unix time after which the decode side refuses it
    mac: str = ""  # recap.disagg.trust.sign over `signed_fields()` and the prompt

    def signed_fields(self) -> dict[str, Any]:
        o = self.offer
        return {"remote_address": self.address, "transfer_id": self.transfer_id, "block_size": self.block_size,
                "num_prompt_tokens": o.num_prompt_tokens, "first_token_id": o.first_token_id,
                "checkpoint_positions": list(o.checkpoint_positions), "prompt_digest": o.prompt_digest,
                "window_start": o.window_start, "expires_at": self.expires_at}

    def to_params(self) -> dict[str, Any]:
        return {**self.signed_fields(), "mac": self.mac}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemoteHandle:
        """Parse a decode request's kv_transfer_params; ValueError names the bad field."""
        extra = sorted(set(params) - {*_HANDLE_FIELDS, "do_remote_prefill"})
        if extra:
            raise ValueError(f"unknown field(s) {', '.join(extra)}")
        if params.get("do_remote_prefill") is not True:
            raise ValueError("a decode instance needs do_remote_prefill: true and the prefill side's handle")
        address = _field(params, "remote_address", str)
        if not (_ADDRESS.fullmatch(address) or _RAY_REPLICA.fullmatch(address)):
            raise ValueError(f"remote_address must look like tcp://host:port (or ray://app/deployment/replica), "
                             f"got {address!r}")
        positions = _field(params, "checkpoint_positions", list)
        if not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in positions):
            raise ValueError("checkpoint_positions must be positive integers")
        digest = _field(params, "prompt_digest", str)
        if not _DIGEST.fullmatch(digest):
            raise ValueError("prompt_digest must be 32 hex digits")
        # The first prompt block whose sliding-window block is held; null for a model without window layers.
        window_start = params.get("window_start", False)
        if window_start is not None and not (type(window_start) is int and window_start >= 0):
            raise ValueError("window_start is missing or not null or a non-negative integer")
        offer = RemoteOffer(_field(params, "num_prompt_tokens", int), _field(params, "first_token_id", int),
                            tuple(positions), digest, window_start)
        expires_at = params.get("expires_at")
        if not isinstance(expires_at, (int, float)) or isinstance(expires_at, bool) or not math.isfinite(expires_at):
            raise ValueError("expires_at is missing or not a number")
        mac = _field(params, "mac", str)
        if not _TAG.fullmatch(mac):
            raise ValueError("mac must be 64 hex digits")
        return cls(address, _field(params, "transfer_id", str), _field(params, "block_size", int), offer,
                   float(expires_at), mac)


def _field(params: dict[str, Any], name: str, kind: type) -> Any:
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
        raise ValueError(f"{name} is missing or not a {'non-negative integer' if kind is int else kind.__name__}")
    return value


# -- flags -------------------------------------------------------------------------------------------
def add_disagg_args(p: argparse.ArgumentParser) -> None:
    """`recap serve` flags for disaggregation (default role: both, today's single instance)."""
    d = KVTransferConfig()
    p.add_argument("--role", choices=ROLES, default=d.role,
                   help="prefill: compute prompts and hold their KV for a decode instance; decode: receive it")
    p.add_argument("--kv-host", default=d.kv_host, help="prefill: interface of the KV transfer server")
    p.add_argument("--kv-port", type=int, default=d.kv_port, help="prefill: KV transfer server port (0: any)")
    p.add_argument("--kv-transfer-timeout", type=float, default=d.transfer_timeout_s,
                   help="decode: seconds before a KV pull fails its request (504)")
    p.add_argument("--kv-hold-timeout", type=float, default=d.hold_timeout_s,
                   help="prefill: seconds held KV waits for its pull before it is released")
    p.add_argument("--kv-accept-timeout", type=float, default=d.accept_timeout_s,
                   help="prefill: seconds held KV waits for a decode instance to accept its handle (then up to "
                        "--kv-hold-timeout for the pull)")
    p.add_argument("--kv-max-holds", type=int, default=d.max_holds,
                   help="prefill: held requests waiting for their pull at which new ones get 429 (0: half of "
                        "--max-num-seqs)")
    p.add_argument("--kv-max-holds-per-client", type=int, default=d.max_holds_per_client,
                   help="prefill: held requests one client address may have at once (0: --kv-max-holds)")
    p.add_argument("--fallback-local-prefill", action="store_true",
                   help="decode: when a KV transfer fails, prefill the request locally instead of failing it")
    p.add_argument("--kv-send-delay", type=float, default=d.send_delay_s, help=argparse.SUPPRESS)  # test hook
    p.add_argument("--kv-secret-file", type=Path, default=None, metavar="PATH",
                   help="prefill/decode: the deployment's shared secret that signs transfer handles; created "
                        "(random, mode 0600) when the file does not exist yet")
    p.add_argument("--kv-secret", default=None, help="prefill/decode: the shared secret itself (prefer the file)")
    add_kv_api_key_arg(p)
    p.add_argument("--kv-peer", action="append", default=[], metavar="tcp://HOST:PORT",
                   help="decode: a prefill peer's transfer address (its --kv-host/--kv-port); repeat for several. "
                        "Handles naming any other address are refused")


def transfer_config(args: argparse.Namespace) -> KVTransferConfig:
    """Raises ValueError naming the field when a value is out of range."""
    return KVTransferConfig(
        role=args.role, kv_host=args.kv_host, kv_port=args.kv_port, transfer_timeout_s=args.kv_transfer_timeout,
        hold_timeout_s=args.kv_hold_timeout, accept_timeout_s=args.kv_accept_timeout, max_holds=args.kv_max_holds,
        max_holds_per_client=args.kv_max_holds_per_client, fallback_local_prefill=args.fallback_local_prefill,
        send_delay_s=args.kv_send_delay, secret=_secret(args), peers=tuple(args.kv_peer), api_key=args.kv_api_key or "",
    )


def add_kv_api_key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-api-key", default=None,
                   help="the credential a prefill instance asks of do_remote_decode requests and the proxy sends "
                        "(header x-kv-api-key); default: derived from the shared secret")


def _secret(args: argparse.Namespace, needed: bool | None = None) -> bytes:
    if args.kv_secret is not None and args.kv_secret_file is not None:
        raise ValueError("secret: give --kv-secret or --kv-secret-file, not both")
    if args.kv_secret is not None:
        return parse_secret(args.kv_secret)
    if args.kv_secret_file is not None and (args.role != "both" if needed is None else needed):
        try:
            return load_or_create_secret(args.kv_secret_file)
        except OSError as e:
            raise ValueError(f"secret: cannot read or create {args.kv_secret_file}: {e}") from None
    return b""


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance (recap serve --role prefill); repeat for several (round robin)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance (recap serve --role decode); repeat for several (round robin)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument("--kv-secret-file", type=Path, default=None, metavar="PATH",
                   help="the deployment's shared secret (as given to the instances): the proxy derives the "
                        "credential of its prefill requests from it")
    p.add_argument("--kv-secret", default=None, help="the shared secret itself (prefer the file)")
    add_kv_api_key_arg(p)
    from recap.http.limits import add_limit_args  # here: the rest of this module needs no HTTP stack

    add_limit_args(p)


def proxy_kv_api_key(args: argparse.Namespace) -> str:
    """The credential `recap proxy` sends with its prefill requests: --kv-api-key, or derived from the secret."""
    if args.kv_api_key:
        return str(args.kv_api_key)
    secret = _secret(args, needed=True)
    if not secret:
        raise ValueError("the proxy needs the prefill instances' credential: --kv-secret-file (the deployment's "
                         "shared secret) or --kv-api-key")
    return derive_api_key(secret)
