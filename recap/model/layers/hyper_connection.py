"""Manifold-constrained hyper-connections (mHC, GLM-5.3-Flash): each token carries N residual streams.

Around every block (attention or feed-forward) of a decoder layer, with streams X [T, N, D]:
    a = fn @ rms(flatten(X))  (no weight on the norm; fp32)           -> pre [N] | post [N] | comb [N, N]
    pre = sigmoid(a_pre * s0 + b_pre) + eps;  post = 2 sigmoid(a_post * s1 + b_post)
    comb = Sinkhorn(softmax(a_comb * s2 + b_comb, rows) + eps)       (doubly stochastic, `iters` rounds)
    block input = sum_n pre_n X_n;  new X = post (x) block(input) + comb^T @ X
The model's first streams are N copies of the embedding; the head collapses them by an unweighted mean.
"""

from __future__ import annotations

import torch
from torch import nn


class HyperConnection(nn.Module):
    """One block's mHC: `collapse` gives the block input and the mixing weights, `expand` the new streams."""

    def __init__(self, hidden_size: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        if streams < 1 or sinkhorn_iters < 1:
            raise ValueError(f"hyper-connections need streams >= 1 and sinkhorn_iters >= 1, got {streams}, "
                             f"{sinkhorn_iters}")  # fmt: skip
        self.streams, self.iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        width = (2 + streams) * streams  # pre (N) | post (N) | comb (N x N)
        self.fn = nn.Parameter(torch.zeros(width, streams * hidden_size, dtype=dtype), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(width, dtype=dtype), requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=False)

    def _sinkhorn(self, comb: torch.Tensor) -> torch.Tensor:
        # columns first, then (iters - 1) rounds of rows and columns, as the checkpoint's reference
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return comb

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, block input [T, D])."""
        t, n, _ = streams.shape
        if n != self.streams:
            raise ValueError(f"expected {self.streams} residual streams, got {n}")
        flat = streams.reshape(t, -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        a = flat @ self.fn.float().T
        a_pre, a_post, a_comb = a.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_comb = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(a_pre * s_pre + b_pre) + self.eps
        post = 2 * torch.sigmoid(a_post * s_post + b_post)
        comb = torch.softmax(a_comb.view(t, n, n) * s_comb + b_comb.view(n, n), dim=-1) + self.eps
        block_input = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        return post, self._sinkhorn(comb), block_input

    @staticmethod
    def expand(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The block's output [T, D] spread over the streams plus the mixed residual streams -> [T, N, D]."""
        dtype = streams.dtype
        return post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hyper_streams(x: torch.Tensor, streams: int) -> torch.Tensor:
    """The first residual streams: N copies of each token's embedding, [T, D] -> [T, N, D]."""
    return x[:, None, :].expand(-1, streams, -1).contiguous()


def hyper_head(streams: torch.Tensor) -> torch.Tensor:
    """The final collapse before the norm: an unweighted mean over the streams, [T, N, D] -> [T, D]."""
    return streams.mean(dim=1)
