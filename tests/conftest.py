"""Test setup shared by every test module.

Without a GPU, the Triton kernels run in Triton's CPU interpreter. It is
switched on here, before any test module imports Triton (its @triton.jit
decorator reads TRITON_INTERPRET when the kernel modules are imported), so
that `python -m pytest` runs them with no extra command.
"""

import os

import helpers
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A run folder of `flashformer train` (a tiny byte-level GPT, 6 steps,
    checkpoints at 3 and 6), trained once for every test that reads one."""
    from helpers import TINY_RUN_PROMPT, train_tiny_run

    out = tmp_path_factory.mktemp("run")
    summary = train_tiny_run(tmp_path_factory.mktemp("corpus"), out)
    assert summary["sample"].startswith(
        TINY_RUN_PROMPT
    )  # the trainer's own sampling call went through generate
    return out


# ---- generation: (family, transformers model, flashformer model) pairs, built once per session ----


@pytest.fixture(scope="session", params=sorted(helpers.GENERATION_FAMILIES))
def pair(request, tmp_path_factory):
    return helpers.load_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="session", params=["gpt2", "llama-gqa"])
def decoder_pair(request, tmp_path_factory):
    return helpers.load_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def t5_pair(tmp_path_factory):
    return helpers.load_pair("t5", tmp_path_factory)
