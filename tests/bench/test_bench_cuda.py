"""The CUDA benchmark's arithmetic and plumbing, checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from flashformer.bench import attention_cuda


def test_flop_convention():
    # forward: two matmuls of 2 * n * n * D each per (batch, head); causal halves it
    assert attention_cuda.flops(2, 3, 1024, 64, False, "forward") == 4 * 2 * 3 * 1024 * 1024 * 64
    assert attention_cuda.flops(2, 3, 1024, 64, True, "forward") == 2 * 2 * 3 * 1024 * 1024 * 64
    assert attention_cuda.flops(2, 3, 1024, 64, True, "backward") == 2.5 * 2 * 2 * 3 * 1024 * 1024 * 64


def test_targets_compare_triton_with_the_best_sdpa_backend():
    def point(method, fwd, bwd, n=4096):
        return {"method": method, "head_dim": 128, "causal": True, "n": n,
                "forward": {"tflops": fwd}, "backward": {"tflops": bwd}}  # fmt: skip

    points = [
        point("triton", 400.0, 200.0),
        point("sdpa_flash", 500.0, 300.0),
        point("sdpa_cudnn", 320.0, 400.0),
        point("flex", 900.0, 900.0),  # not an SDPA backend: no part of the ratio
    ]
    targets = attention_cuda.targets(points)
    assert targets["D128 causal n=4096 forward: triton TFLOP/s (target >= 450)"] == 400.0
    assert targets["D128 causal n=4096 forward: triton / best SDPA backend (target >= 0.9)"] == pytest.approx(
        0.8
    )
    assert targets[
        "D128 causal n=4096 backward: triton / best SDPA backend (target >= 0.9)"
    ] == pytest.approx(0.5)
    assert targets["D128 full n=4096 forward: triton TFLOP/s (target >= 450)"] is None  # not measured


def test_each_point_gets_a_row_with_its_result_or_the_reason_it_has_none():
    """One row per point, measured or failed. Without CUDA every point fails,
    and its row says why (CUDA is missing); with CUDA every point is timed."""
    config = {"ns": [256, 512], "head_dims": [64], "causal": [False, True]}
    points = attention_cuda._run_method("sdpa_flash", config, timeout_s=120)
    assert {(p["causal"], p["n"]) for p in points} == {(False, 256), (False, 512), (True, 256), (True, 512)}
    assert len(points) == 4
    if torch.cuda.is_available():
        assert all(p["forward"]["tflops"] > 0 and p["backward"]["tflops"] > 0 for p in points), points
    else:
        assert all("CUDA" in p.get("error", "") for p in points), points
