"""bitsplit-llama: GGUF models as a 2-bit base plus a residual, self-speculative on llama.cpp.

Nothing native is loaded at import time; the heavy parts load on first use.
"""

from __future__ import annotations

from ._version import __version__
from .errors import (BitsplitError, BusyError, ContextLimitError, ContextWindowError, GGUFFormatError, InputError,
                     InvalidOptionError, MismatchError, NativeError, OutputError, UnsupportedModelError)

__all__ = [
    "BitsplitError", "BusyError", "ContextLimitError", "ContextWindowError", "GGUFFormatError", "InputError", "InvalidOptionError",
    "MismatchError", "NativeError", "OutputError", "UnsupportedModelError", "split_model", "split_info",
    "fetch_model", "BitsplitLlama", "GenerationOptions", "SamplingParams", "__version__",
]


def __getattr__(name: str):
    if name == "split_model":
        from .formats.split import split_model

        return split_model
    if name == "split_info":
        from .formats.modeldir import split_info

        return split_info
    if name == "BitsplitLlama":
        from .api.llama import get_class

        return get_class()
    if name == "GenerationOptions":
        from .speculative.options import GenerationOptions

        return GenerationOptions
    if name == "SamplingParams":
        from .speculative.sampling import SamplingParams

        return SamplingParams
    if name == "fetch_model":
        from .tools.fetch import fetch_model

        return fetch_model
    raise AttributeError(f"module 'bitsplit_llama' has no attribute {name!r}")
