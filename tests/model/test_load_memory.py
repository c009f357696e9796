"""Loading and preparing a model holds one copy of each weight, in the serving format, and no transient copy of
the whole model: peak (VmHWM) and steady (VmRSS) resident memory of a fresh process per format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recap.model.layers.linear import onednn_available
from recap.model.quant import int8_available
from recap.model.safetensors_file import stored_tensors

# A random Mamba2 of 35M parameters (hidden 512, 16 layers, vocab 8000, untied head; fp32 on disk): the linear
# layers hold 31M of them, no single tensor dominates (the largest, the embedding and the head, 4.1M each).
CONFIG = {"hidden_size": 512, "num_hidden_layers": 16, "num_heads": 16, "head_dim": 64, "vocab_size": 8000,
          "n_groups": 1, "state_size": 64, "tie_word_embeddings": False}  # fmt: skip

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from recap.model.testing import make_tiny_checkpoint

    return make_tiny_checkpoint("mamba2", tmp_path_factory.mktemp("mamba2-35m"), seed=0, **CONFIG)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
@pytest.mark.parametrize(("dtype", "quantization"),
                         [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "int4")])
def test_load_and_prepare_hold_one_copy_in_the_serving_format(
    dtype: str, quantization: str | None, checkpoint: Path
) -> None:
    """peak - baseline <= held * 1.15 + one layer's transient, where held is what the prepared model keeps (its
    parameters, buffers and the linear layers' own layouts: the serving format), the baseline is the process
    after importing torch and recap (measured in it before loading), and the transient is TRANSIENT_TENSORS x
    the largest checkpoint tensor's bytes (fp32, 16 MiB here): one layer at a time is read (fp32 on disk; a bf16
    model casts it through one buffer), laid out (the new layout beside the old), or quantized (its fp32 weight
    and one fp32 temporary beside the int8 matrix and its tiles: one tensor more). Steady memory: held * 1.15 +
    16 MiB over the baseline."""
    if quantization == "int8" and not int8_available():
        pytest.skip("no fbgemm in this torch")  # (int4 falls back to its torch reference, which needs nothing)
    if not onednn_available():
        pytest.skip("the serving layouts need oneDNN")
    out = subprocess.run([sys.executable, "-m", "recap.bench.load_probe", str(checkpoint), dtype, quantization or "-"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    with open(checkpoint / "model.safetensors", "rb") as f:
        stored = stored_tensors(f, "model.safetensors")
    params = sum(t.nbytes for t in stored) // 4  # fp32 on disk
    transient = (TRANSIENT_TENSORS + (1 if quantization else 0)) * max(t.nbytes for t in stored)
    # One copy: fp32 ~4 bytes a parameter (three copies held 12), bf16 ~2; int8 ~1 for the linear weights (the
    # native tiles alone, or fbgemm's copy where they do not build) beside the fp32 embedding (4M of 35M)
    per_param = {"int8": 2.0, "int4": 1.6}.get(quantization or "", 4.5 if dtype == "float32" else 2.5)
    assert m["held"] < params * per_param, f"held {m['held']} B for {params} parameters"
    peak, steady = m["peak"] - m["baseline_peak"], m["rss"] - m["baseline_rss"]
    print(f"{dtype} {quantization}: held {m['held'] / 2**20:.1f} MiB, peak +{peak / 2**20:.1f}, steady "
          f"+{steady / 2**20:.1f} over a baseline of {m['baseline_rss'] / 2**20:.1f} MiB")  # fmt: skip
    assert peak <= m["held"] * 1.15 + transient, f"peak {peak / 2**20:.0f} MiB for {m['held'] / 2**20:.0f} MiB held"
    assert steady <= m["held"] * 1.15 + (16 << 20), f"steady {steady / 2**20:.0f} MiB for {m['held'] / 2**20:.0f}"


TRANSIENT_TENSORS = 3
