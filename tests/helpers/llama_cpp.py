"""llama.cpp's own tools where a build has them (FLASHFORMER_LLAMA_CPP_DIR, else the usual
folders of this machine): llama-perplexity's KL divergence, the reference the quantized families
are held to (within 2x its error). Tests that need them skip without them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


def llama_perplexity() -> Path | None:
    """bin/llama-perplexity of the llama.cpp build in FLASHFORMER_LLAMA_CPP_DIR (else the usual
    folders of this machine), or None."""
    folders = [
        os.environ.get("FLASHFORMER_LLAMA_CPP_DIR"),
        "/work/llama.cpp/build-native",
        "/work/llama/build-native",
    ]
    for folder in filter(None, folders):
        for path in (Path(folder) / "bin" / "llama-perplexity", Path(folder) / "llama-perplexity"):
            if path.is_file():
                return path
    return None


def run_llama_perplexity(binary: Path, model: Path, *options: str) -> str:
    """Its output. llama-perplexity prints its closing statistics through llama.cpp's asynchronous
    logger, which sometimes exits before writing them (half of 8 runs on this machine, exit code
    0): a run whose --kl-divergence summary is missing is run again, up to 5 times."""
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
