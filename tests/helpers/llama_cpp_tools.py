"""llama.cpp's command-line tools where a build of them is on this machine: the folder in
FLASHFORMER_LLAMA_CPP_DIR, else the usual ones (a tree of its own, or the one llama-cpp-python's
source distribution vendors, built as docs/benchmarks.md's "The peers" says). Tests that need
them skip without them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

FOLDERS = (
    "/work/llama.cpp/build-native",
    "/work/llama/build-native",
    "/work/peer/llama_cpp_python-0.3.36/vendor/llama.cpp/build-native",
)


def llama_cpp_tool(name: str) -> Path | None:
    """bin/<name> (llama-perplexity, llama-quantize, ...) of the first build that has it, or None."""
    for folder in filter(None, (os.environ.get("FLASHFORMER_LLAMA_CPP_DIR"), *FOLDERS)):
        for path in (Path(folder) / "bin" / name, Path(folder) / name):
            if path.is_file():
                return path
    return None


def llama_perplexity() -> Path | None:
    return llama_cpp_tool("llama-perplexity")


def run_llama_perplexity(binary: Path, model: Path, *options: str) -> str:
    """Its output, over chunks of 32 tokens. llama-perplexity prints its closing statistics
    through llama.cpp's asynchronous logger, which sometimes exits before writing them (half of
    8 runs on one machine, exit code 0): a run whose --kl-divergence summary is missing is run
    again, up to 5 times."""
    for _ in range(5):
        done = subprocess.run([str(binary), "-m", str(model), "-c", "32", "-b", "32", "-t", "2", *options],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        output = done.stdout + done.stderr
        if "--kl-divergence" not in options or re.search(r"Mean +KLD:", output):
            break
    return output


def printed_mean_kld(output: str) -> float:
    return float(re.search(r"Mean +KLD: +(-?[\d.]+)", output).group(1))
