"""benchmarks/gpu_check.py's reading of a pytest run: the summary line wherever -rfE and --durations put it, every
failure line kept, failures per file and each distinct reason counted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:  # benchmarks/ is scripts, not a package
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


PIN = "RuntimeError: cannot pin 'torch.cuda.LongTensor' only dense CPU tensors can be pinned"
PTR = "ValueError: Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)"
# -q -rfE --tb=line with the project's --durations: the summary line before the durations and the stderr
RUN = "\n".join([
    "..F.F.s" + "." * 40 + "F  [ 40%]",
    "FF.....  [100%]",
    "/work/tests/kernels/triton/test_ssd.py:120: " + PIN,
    *(f"FAILED tests/kernels/triton/test_ssd.py::test_ssd_varlen_matches_reference[{i}] - {PIN}" for i in range(45)),
    f"FAILED tests/kernels/triton/test_paged_attention.py::test_mixed_batches_match_the_reference[0] - {PTR}",
    "ERROR tests/kernels/triton/test_mla.py - ImportError: no module named x",
    "47 failed, 52 passed, 1 skipped, 1 error in 81.27s (0:01:21)",
    "============================= slowest 25 durations =============================",
    "2.57s call     tests/kernels/triton/test_paged_attention.py::test_decode_batch_with_gqa_and_a_padding_row[100-1]",
    "",
    "a warning on stderr",
])  # fmt: skip


def test_summary_counts_and_every_failure_line() -> None:
    got = _module().parse_pytest_output(RUN)
    assert got["summary"] == "47 failed, 52 passed, 1 skipped, 1 error in 81.27s (0:01:21)"
    assert got["counts"] == {"failed": 47, "passed": 52, "skipped": 1, "error": 1}
    assert len(got["failed"]) == 47  # all of them, not the first 40
    assert got["failed_per_file"] == {
        "tests/kernels/triton/test_mla.py": 1,
        "tests/kernels/triton/test_paged_attention.py": 1,
        "tests/kernels/triton/test_ssd.py": 45,
    }
    assert got["reasons"] == {PIN: 45, PTR: 1, "ImportError: no module named x": 1}
    assert got["failed_marks"] == 5


def test_a_run_stopped_before_its_summary() -> None:
    got = _module().parse_pytest_output("....F\n(stopped after 30 s)")
    assert got["summary"] == "" and got["counts"] == {} and got["failed_marks"] == 1 and got["passed_dots"] == 4


def test_async_decode_rows_beside_the_synchronous_rates(tmp_path: Path) -> None:
    """The speed section's async rows, run on the CPU (what --device cpu --smoke runs) on a tiny Nemotron-H."""
    import torch

    from recap.model.testing import make_tiny_checkpoint
    from tests.tiny_tokenizer import save_tiny_tokenizer

    torch.set_num_threads(1)
    mod = _module()
    path = make_tiny_checkpoint("nemotron_h", tmp_path / "nemotron_h")
    save_tiny_tokenizer(path, vocab_size=512)
    cpu = torch.device("cpu")
    sync = mod._speed_engine(path, str(path), cpu, 64, pool_bytes=32 << 20)
    assert not sync.config.scheduler.async_scheduling
    rates = {b: mod._decode_rate(sync, b, 4, cpu, 512) for b in mod.ASYNC_BATCHES}
    rows = mod.async_decode(path, str(path), cpu, 64, 512, 4, rates, pool_bytes=32 << 20)
    assert list(rows) == ["b1", "b32"]
    for batch, row in zip(mod.ASYNC_BATCHES, rows.values()):
        assert row["off_tok_s"] == rates[batch] and row["on_tok_s"] > 0
        assert row["on_over_off"] == row["on_tok_s"] / row["off_tok_s"]


def test_card_limits_follow_the_card_and_the_flags() -> None:
    gc = _module()
    h200 = gc.card_limits("NVIDIA H200", None, None)
    assert (h200["hbm_bytes_s"], h200["bf16_flops"]) == (4.8e12, 989e12) and "H200" in h200["source"]
    sxm = gc.card_limits("NVIDIA H100 80GB HBM3", None, None)  # the SXM's name, which no more specific row takes
    assert (sxm["hbm_bytes_s"], sxm["bf16_flops"]) == (gc.H100_HBM_BYTES_S, gc.H100_BF16_FLOPS)
    assert gc.card_limits("NVIDIA H100 PCIe", None, None)["hbm_bytes_s"] == 2.0e12
    assert gc.card_limits("NVIDIA A100-SXM4-40GB", None, None)["hbm_bytes_s"] == 1.555e12
    unknown = gc.card_limits("Some Future GPU", None, None)
    assert unknown["hbm_bytes_s"] == gc.H100_HBM_BYTES_S and "not in CARD_LIMITS" in unknown["source"]
    assert "no GPU" in gc.card_limits(None, None, None)["source"]  # a CPU run (--smoke)
    flags = gc.card_limits("NVIDIA H200", 1e12, None)  # one flag: the other figure stays the card's
    assert (flags["hbm_bytes_s"], flags["bf16_flops"]) == (1e12, 989e12) and flags["source"].startswith("flags")
