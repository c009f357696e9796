"""recap: prefix caching for recurrent state in hybrid (Mamba + attention) language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recap.sampling_params import SamplingParams

if TYPE_CHECKING:
    from recap.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; keep `import recap.core` torch-free.
    if name == "LLM":
        from recap.engine.llm import LLM

        return LLM
    raise AttributeError(name)
