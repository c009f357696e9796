"""The SSM kernels' tiling (kernels/tiling.py) on random rows, context lengths and checkpoint positions: chunks
never cross the chunk grid, every checkpoint is a chunk end and a segment end, and chunks, pieces, SSD chunks
and segments each cover every row exactly once, in order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from recap.core.output import PAD_SLOT_ID
from recap.kernels.tiling import Chunks, RowTokens, chunk_rows, cut_pieces, plan_segments, row_chunk_ends


@st.composite
def _rows(draw: st.DrawFn) -> list[RowTokens]:
    rows = []
    for r in range(draw(st.integers(1, 5))):
        ctx = draw(st.integers(0, 300))
        n = draw(st.integers(1, 300))
        every = draw(st.sampled_from([0, 1, 7, 16]))  # 0: random positions only
        picked = draw(st.sets(st.integers(ctx + 1, ctx + n), max_size=6))
        positions = picked | ({p for p in range(ctx + 1, ctx + n + 1) if p % every == 0} if every else set())
        rows.append(RowTokens(ctx, n, {p: 1000 * r + i for i, p in enumerate(sorted(positions))}))
    return rows


def _starts(rows: list[RowTokens]) -> list[int]:
    """[B+1] each row's first packed offset, then the token count."""
    qsl = [0]
    for r in rows:
        qsl.append(qsl[-1] + r.num_tokens)
    return qsl


def _position(rows: list[RowTokens], qsl: list[int], row: int, offset: int) -> int:
    """The absolute position after the tokens of `row` up to packed offset `offset`."""
    return rows[row].context_len + offset - qsl[row]


def _assert_cover(spans: list[tuple[int, int, int]], qsl: list[int]) -> None:
    """spans (row, start, end) are non-empty and tile each row's tokens exactly once, in order."""
    assert all(a < b for _, a, b in spans)
    assert [(row, a) for row, a, _ in spans] == sorted((row, a) for row, a, _ in spans)
    for row in range(len(qsl) - 1):
        mine = [(a, b) for r, a, b in spans if r == row]
        assert mine[0][0] == qsl[row] and mine[-1][1] == qsl[row + 1]
        assert all(b == a2 for (_, b), (a2, _) in zip(mine, mine[1:]))


def _chunk_spans(chunks: Chunks) -> list[tuple[int, int, int]]:
    return [(row, chunks.cu[c], chunks.cu[c + 1]) for c, row in enumerate(chunks.rows)]


@given(_rows(), st.integers(1, 96))
def test_chunks_cut_at_grid_checkpoints_and_row_ends_only(rows: list[RowTokens], chunk_size: int) -> None:
    chunks, qsl = chunk_rows(rows, chunk_size), _starts(rows)
    _assert_cover(_chunk_spans(chunks), qsl)
    for row, a, b in _chunk_spans(chunks):
        r = rows[row]
        start, end = _position(rows, qsl, row, a), _position(rows, qsl, row, b)
        assert start // chunk_size == (end - 1) // chunk_size  # inside one grid cell
        assert end % chunk_size == 0 or end in r.checkpoints or b == qsl[row + 1]  # no other cut
    ends = {(row, p): d for row, p, d in zip(chunks.rows, chunks.end_positions, chunks.dest_slots)}
    for row, r in enumerate(rows):
        for p, slot in r.checkpoints.items():
            assert ends[(row, p)] == slot  # every checkpoint is a chunk end, with its slot
    planned = {(row, p, d) for row, r in enumerate(rows) for p, d in r.checkpoints.items()}
    assert sorted(chunks.checkpoints()) == sorted(planned)
    last = [max(c for c, x in enumerate(chunks.rows) if x == row) for row in range(len(rows))]
    assert chunks.row_last(len(rows)) == last


@given(_rows(), st.integers(1, 96), st.integers(1, 40))
def test_pieces_tile_each_chunk_from_its_start(rows: list[RowTokens], chunk_size: int, size: int) -> None:
    chunks = chunk_rows(rows, chunk_size)
    pieces = cut_pieces(chunks, size)
    _assert_cover([(p.row, p.start, p.end) for p in pieces], _starts(rows))
    for c in range(len(chunks.rows)):
        mine = [p for p in pieces if chunks.cu[c] <= p.start < chunks.cu[c + 1]]
        assert mine[-1].end == chunks.cu[c + 1] and mine[-1].chunk == c
        assert all(p.end - p.start == size and p.chunk == -1 for p in mine[:-1])
        assert 0 < mine[-1].end - mine[-1].start <= size


@given(_rows(), st.integers(1, 96), st.integers(1, 80), st.data())
def test_segments_end_at_every_checkpoint_and_chunks_stay_in_the_grid(
    rows: list[RowTokens], chunk_size: int, sub: int, data: st.DataObject
) -> None:
    chunks, qsl = chunk_rows(rows, chunk_size), _starts(rows)
    slots = [data.draw(st.sampled_from([PAD_SLOT_ID, 7 + row])) for row in range(len(rows))]
    plan = plan_segments(chunks, slots, chunk_size, sub)
    nc = len(plan.cu) - 1
    chunk_row = [plan.seg_rows[s] for s in plan.chunk_last_seg]
    ssd_spans = [(chunk_row[c], plan.cu[c], plan.cu[c + 1]) for c in range(nc)]
    _assert_cover(ssd_spans, qsl)
    for row in range(len(rows)):
        assert chunk_row[plan.first[row] : plan.first[row] + plan.counts[row]] == [row] * plan.counts[row]
    for row, a, b in ssd_spans:  # SSD chunks: <= sub tokens, cut from their grid cell's start
        start, end = _position(rows, qsl, row, a), _position(rows, qsl, row, b)
        assert start // chunk_size == (end - 1) // chunk_size and end - start <= sub
        assert (start - max(rows[row].context_len, start // chunk_size * chunk_size)) % sub == 0
    seg_spans = [(row, plan.cu[c] + a, plan.cu[c] + b) for (c, a, b), row in zip(plan.segments, plan.seg_rows)]
    _assert_cover(seg_spans, qsl)
    assert [plan.segments[s][2] for s in plan.chunk_last_seg] == [b - a for _, a, b in ssd_spans]
    seg_ends = {(row, _position(rows, qsl, row, b)): s for s, (row, _, b) in enumerate(seg_spans)}
    chunk_ends = {(row, _position(rows, qsl, row, b)) for row, _, b in _chunk_spans(chunks)}
    ssd_ends = {(row, _position(rows, qsl, row, b)) for row, _, b in ssd_spans}
    assert set(seg_ends) == chunk_ends | ssd_ends  # every chunk end is a segment end, and no other cut
    cps = [(row, p, slot) for row, r in enumerate(rows) for p, slot in sorted(r.checkpoints.items())]
    expected = [(seg_ends[(row, p)], slot, p) for row, p, slot in cps]
    assert plan.checkpoints == expected  # every checkpoint is a segment end, its slot written there
    assert plan.split == any(end not in {b for _, _, b in ssd_spans} for _, _, end in seg_spans)
    running = [(plan.first[row] + plan.counts[row] - 1, slot, r.context_len + r.num_tokens)
               for row, (r, slot) in enumerate(zip(rows, slots)) if slot != PAD_SLOT_ID]  # fmt: skip
    assert plan.running == running


def test_row_chunk_ends_example() -> None:
    """10 tokens in context, 30 new, grid 16, a checkpoint at 12: cuts at 12, 16, 32 and the row end 40."""
    assert row_chunk_ends(10, 30, 16, [12]) == [2, 6, 22, 30]
    assert row_chunk_ends(16, 16, 16, []) == [16]  # a row on the grid: one full cell
