"""Checkpoint policies: exact positions per chunk."""

from __future__ import annotations

from recap.config import CacheConfig
from recap.core.policy import CheckpointPolicy
from recap.core.request import Request

BS = 4


def policy(name: str, **kw: object) -> CheckpointPolicy:
    return CheckpointPolicy(CacheConfig(block_size=BS, checkpoint_policy=name, **kw), has_state=True)  # type: ignore[arg-type]


def positions(p: CheckpointPolicy, r: Request, start: int, end: int) -> list[tuple[int, bool]]:
    return p.positions(r, start, end)


R = Request("r", list(range(30)), 20, segment_boundaries=(10, 21))  # prompt end 28; segments 8, 20


def test_none_and_no_state_write_nothing() -> None:
    p = policy("none")
    p.admit(R, 0, 0)
    assert positions(p, R, 0, 30) == []
    q = CheckpointPolicy(CacheConfig(block_size=BS), has_state=False)
    assert not q.enabled and q.positions(R, 0, 30) == []
    off = CheckpointPolicy(CacheConfig(block_size=BS, enable_prefix_caching=False), has_state=True)
    assert off.positions(R, 0, 30) == []


def test_align_prompt_end_only() -> None:
    p = policy("align")
    p.admit(R, 0, 0)
    assert positions(p, R, 0, 30) == [(28, False)]
    assert positions(p, R, 0, 27) == []  # a chunk that stops short does not reach it
    assert positions(p, R, 27, 28) == [(28, False)]
    assert positions(p, R, 30, 32) == []  # no decode snapshots


def test_all_every_boundary() -> None:
    p = policy("all")
    assert positions(p, R, 0, 30) == [(p_, False) for p_ in range(4, 29, 4)]
    assert positions(p, R, 3, 5) == [(4, False)]
    assert positions(p, R, 31, 32) == [(32, False)]


def test_recap_segments_prompt_end_and_decode_snapshots() -> None:
    p = policy("recap")
    p.admit(R, 0, 0)
    assert positions(p, R, 0, 30) == [(8, False), (20, False), (28, False)]
    assert positions(p, R, 30, 31) == []
    assert positions(p, R, 31, 32) == [(32, True)]  # decode end snapshot, provisional
    # A resumed request recomputing outputs in one chunk snapshots only the last boundary.
    assert positions(p, R, 28, 41) == [(40, True)]


def test_recap_learns_branch_point_from_kv_hit_past_checkpoint() -> None:
    p = policy("recap")
    p.admit(R, 8, 16)
    assert positions(p, R, 8, 30) == [(16, False), (20, False), (28, False)]
    assert p.num_branch_points == 1


def test_recap_interval_and_geometric() -> None:
    p = policy("recap", checkpoint_interval=3)
    r = Request("r", list(range(60)), 20)  # prompt end 56
    p.admit(r, 0, 0)
    # 60 is an interval point too (and the boundary at the prompt length).
    assert positions(p, r, 0, 60) == [(12, False), (24, False), (36, False), (48, False), (56, False), (60, False)]
    g = policy("recap", checkpoint_geometric=True)
    r = Request("r", list(range(60)), 20, segment_boundaries=(22,))  # segment 20
    g.admit(r, 0, 0)
    # From 0: 4 8 16 32; from 20: 24 28 36 52; segment 20, prompt end 56, decode end 60.
    got = [p_ for p_, _ in positions(g, r, 0, 60)]
    assert got == [4, 8, 16, 20, 24, 28, 32, 36, 52, 56, 60]
