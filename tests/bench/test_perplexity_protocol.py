"""recap/bench/perplexity.py's llama-cpp protocol: the chunks and scored positions of llama-perplexity -c N."""

from __future__ import annotations

import math

import pytest

from recap.bench.perplexity import chunk_nll, llama_cpp_score_from, llama_cpp_windows, paired_log_ratio

IDS = list(range(100, 140))  # 40 text tokens


def test_chunks_without_bos_are_the_stream_cut_in_whole_chunks() -> None:
    got = llama_cpp_windows(IDS, 8, None)
    assert got == [IDS[i : i + 8] for i in range(0, 40, 8)]  # 5 whole chunks, nothing replaced


def test_chunks_with_bos_lead_the_stream_and_replace_each_chunks_first_token() -> None:
    got = llama_cpp_windows(IDS, 8, 0, chunks=3)
    # the stream is [BOS, 100, 101, ...]: chunk i covers stream[8i : 8i+8], its first token becomes BOS
    assert got == [[0, 100, 101, 102, 103, 104, 105, 106], [0, *range(108, 115)], [0, *range(116, 123)]]


def test_only_the_second_half_of_a_chunk_is_scored() -> None:
    # llama-perplexity: logits from position n/2 predict tokens n/2+1 .. n-1, n/2-1 of them
    assert llama_cpp_score_from(512) == 257 and 512 - llama_cpp_score_from(512) == 255
    assert 8 - llama_cpp_score_from(8) == 3


def test_too_short_a_text_is_refused_as_llama_perplexity_does() -> None:
    with pytest.raises(ValueError, match="at least 16 tokens"):
        llama_cpp_windows(IDS[:15], 8, None)
    with pytest.raises(ValueError, match="at least 4"):
        llama_cpp_windows(IDS, 3, None)


def test_chunk_nll_inverts_llama_perplexitys_running_estimates() -> None:
    per = [1300.0, 1250.5, 1402.25, 1199.0]  # nats of chunks of 255 scored tokens
    running = [math.exp(sum(per[: i + 1]) / (255 * (i + 1))) for i in range(len(per))]
    assert chunk_nll(running, 255) == pytest.approx(per, abs=1e-6)
    rounded = [round(p, 4) for p in running]  # as llama-perplexity prints them
    assert max(abs(a - b) for a, b in zip(chunk_nll(rounded, 255), per, strict=True)) < 255 * 1e-4


def test_paired_log_ratio_cancels_what_both_runs_share() -> None:
    hard = [900.0, 1500.0, 1100.0, 1300.0]  # the windows' difficulty: the same in both runs
    shift = [2.0, 3.0, 2.5, 2.5]  # b is a's NLL less these nats
    mean, se = paired_log_ratio(hard, [h - s for h, s in zip(hard, shift, strict=True)], [250] * 4)
    assert mean == pytest.approx(sum(shift) / 1000) and 0 < se < 0.002  # far below the windows' own spread
    assert paired_log_ratio(hard, hard, [250] * 4) == (0.0, 0.0)
    with pytest.raises(ValueError, match="2 windows"):
        paired_log_ratio([1.0], [1.0], [1])
