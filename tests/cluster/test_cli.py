"""`recap serve --replicas N` flags: parsed, validated before any cluster starts."""

from __future__ import annotations

import pytest

from recap import cli


def test_replica_flags_parse() -> None:
    args = cli.build_parser().parse_args(["serve", "m", "--replicas", "3", "--ray-address", "auto", "--routing",
                                          "round_robin", "--cpus-per-replica", "0.5", "--queued-request-tokens", "64"])
    assert (args.replicas, args.ray_address, args.routing, args.cpus_per_replica, args.queued_request_tokens) == (
        3, "auto", "round_robin", 0.5, 64)
    plain = cli.build_parser().parse_args(["serve"])
    assert plain.replicas is None and plain.ray_address is None and plain.routing == "checkpoint"


@pytest.mark.parametrize(("extra", "message"), [
    (["--replicas", "0"], "replicas must be >= 1"),
    (["--replicas", "2", "--cpus-per-replica", "0"], "cpus_per_replica must be positive"),
    (["--replicas", "2", "--role", "prefill"], "--role prefill/decode is not supported"),
])
def test_bad_replica_flags_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "some/model", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bad_routing_policy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--replicas", "2", "--routing", "random"])
    assert "--routing" in capsys.readouterr().err
