"""Where a DeepSeek-V3-style checkpoint keeps its multi-token-prediction modules (DeepSeek-V3, GLM-4.5 / 4.6,
Ling 3.0): module j as `model.layers.{num_layers + j}.*`, after the last decoder layer. Each holds the fusion
(`enorm`, `hnorm`, `eh_proj`), a full decoder layer under the target's own layer names, its final norm
(`shared_head.norm` for DeepSeek / GLM, `final_layernorm` for Ling) and copies of the shared embedding and head
(`embed_tokens`, `shared_head.head`), which the drafter takes from the target instead.

recap drafts every position with module 0 (checkpoints ship one; with more, the rest are skipped)."""

from __future__ import annotations

import re
from collections.abc import Callable

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSION = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"}
_SHARED = ("embed_tokens.", "word_embeddings.", "shared_head.head.")


def nextn_weight_name(key: str, num_layers: int, rename: Callable[[str], str | None],
                      final_norm: str = "shared_head.norm") -> str | None:  # fmt: skip
    """The MTPHead parameter (model/layers/mtp.py) that `key` holds, or None: not module 0's own weight. The
    decoder layer's weights go through the family's `rename` as if they were layer 0's."""
    m = _LAYER.match(key)
    if m is None or int(m.group(1)) != num_layers:
        return None
    rest = m.group(2)
    if rest.startswith(_SHARED):
        return None
    part, _, param = rest.partition(".")
    if part in _FUSION:
        return f"{_FUSION[part]}.{param}"
    if rest.startswith(final_norm + "."):
        return "norm." + rest.removeprefix(final_norm + ".")
    renamed = rename("model.layers.0." + rest)
    return None if renamed is None else "layers.0." + renamed.removeprefix("model.layers.0.")
