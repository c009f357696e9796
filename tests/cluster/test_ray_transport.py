"""The Ray transport's addressing and refusals, without a cluster (tests/cluster/test_ray_disagg.py moves data)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from recap.cluster.ray_transport import RayTransport, deployment_peer, parse_address  # noqa: E402
from recap.disagg.transport import Outbox  # noqa: E402
from recap.engine.errors import KVTransferError  # noqa: E402


def test_addresses() -> None:
    t = RayTransport("recap-pd", "RecapPrefill", "ab12cd")
    assert t.address == "ray://recap-pd/RecapPrefill/ab12cd"
    assert deployment_peer("recap-pd", "RecapPrefill") == "ray://recap-pd/RecapPrefill"
    assert parse_address(t.address) == ("recap-pd", "RecapPrefill", "ab12cd")
    for bad in ("tcp://127.0.0.1:5555", "ray://recap/RecapPrefill", "ray://a/b/c/d", "ray://a/b/c d"):
        with pytest.raises(KVTransferError, match="not a Ray prefill replica address") as err:
            parse_address(bad)
        assert err.value.status == 502


def test_refusals_need_no_object_store() -> None:
    t = RayTransport("recap", "RecapDecode", "r1")
    assert t.answer({"transfer_id": "x", "mac": "m"}) == {"ok": False, "error": "this replica is not a prefill replica"}
    assert not t.acknowledge("x", "m")
    acked: list[int] = []
    assert t.serve(Outbox(), lambda *a: ({}, []), lambda: acked.append(1)) == t.address
    reply = t.answer({"transfer_id": "cmpl-9-0", "mac": "m"})
    assert reply["ok"] is False and "unknown, expired or taken" in reply["error"] and t.num_sent == 0
    assert not t.acknowledge("cmpl-9-0", "m") and acked == []
