"""omforge: compile Llama-family LLMs to fused, paged-KV ONNX Runtime / Ascend OM artifacts and serve them.

``from omforge import LLM, SamplingParams`` is the offline API (imported lazily: the CLI and the compiler do
not load the runtime).
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from omforge.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from omforge.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'omforge' has no attribute {name!r}")
