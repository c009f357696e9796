"""The Triton GDN gates (recap/kernels/triton/gdn_gates.py) against recap.kernels.gdn.gdn_gates, their reference:
random token counts and head counts, inputs past softplus's threshold and far below 0, strided inputs (a column
slice of a projection), fp32 (the interpreter) and bf16 inputs on a GPU."""

from __future__ import annotations

import pytest
import torch

from recap.kernels.gdn import gdn_gates as gdn_gates_ref
from recap.kernels.triton.gdn_gates import gdn_gates

from .device_rows import DEVICE, TOL

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("seed", "tokens", "heads"), [(0, 1, 4), (1, 37, 6), (2, 300, 32), (3, 1100, 3)])
def test_gates_equal_the_reference(seed: int, tokens: int, heads: int, dtype: torch.dtype) -> None:
    g = torch.Generator(DEVICE).manual_seed(seed)
    wide = torch.randn(tokens, 2 * heads + 3, generator=g) * 12  # softplus's threshold (20) crossed both ways
    a, b = wide[:, 1 : 1 + heads].to(dtype), wide[:, 2 + heads : 2 + 2 * heads].to(dtype)
    A_log, dt_bias = torch.rand(heads, generator=g) * 4 - 2, torch.randn(heads, generator=g) * 3
    got, want = gdn_gates(a, b, A_log, dt_bias), gdn_gates_ref(a, b, A_log, dt_bias)
    for x, y in zip(got, want):
        assert x.dtype == torch.float32 and x.shape == (tokens, heads)
        torch.testing.assert_close(x, y, rtol=TOL * 5, atol=TOL * 5)


def test_mismatched_shapes_are_refused() -> None:
    a = torch.randn(3, 4)
    with pytest.raises(ValueError, match="gates need"):
        gdn_gates(a, torch.randn(3, 5), torch.randn(4), torch.randn(4))
    with pytest.raises(ValueError, match="gates need"):
        gdn_gates(a, a, torch.randn(5), torch.randn(5))
