"""Compile every Triton kernel of flashformer for a GPU target, on a machine
without a GPU (Triton's wheel carries ptxas), and report what each needs.

    python scripts/compile_kernels.py [--arch 90] [--quick]

Catches what Triton's CPU interpreter cannot: code the GPU compiler rejects
(the interpreter runs kernels as Python), shared memory beyond the chip's, and
register spills. For each kernel variant it prints registers per thread, spill
bytes (the stack frame that spilled registers go to), shared memory and whether the matmuls became Hopper
wgmma instructions. tests/test_attention_triton.py runs it with --quick.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashformer.attention.triton import launch  # noqa: E402
from flashformer.attention.triton.backward import (  # noqa: E402
    attention_backward_delta,
    attention_backward_dkdv,
    attention_backward_dq,
)
from flashformer.attention.triton.decode import combine_in_order, decode_combine, decode_split  # noqa: E402
from flashformer.attention.triton.forward import attention_forward  # noqa: E402

POINTERS = {
    "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dlse_ptr": "*fp32", "dbias_ptr": "*fp32", "slopes_ptr": "*fp32",
    "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "mask_ptr": "*u8", "pad_ptr": "*u8",
    "head_keys_ptr": "*i64", "cu_q": "*i32", "cu_k": "*i32", "seqlens_ptr": "*i32", "table_ptr": "*i32",
}  # fmt: skip
FLOATS = {"scale", "softcap", "dropout_scale"}
NO_FEATURES = dict(
    HAS_SOFTCAP=False, HAS_BIAS=False, HAS_MASK=False, HAS_PAD=False, HAS_ALIBI=False,
    HAS_LEFT=False, HAS_RIGHT=False, DROPOUT=False, VARLEN=False,
)  # fmt: skip
ALL_FEATURES = {name: True for name in NO_FEATURES} | {"VARLEN": False}
CAUSAL = NO_FEATURES | {"HAS_RIGHT": True}


def signature(fn, constants: dict, dtype: str) -> dict:
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in POINTERS:
            types[name] = POINTERS[name]
        elif name.endswith("_ptr"):
            types[name] = f"*{dtype}"
        elif name in FLOATS:
            types[name] = "fp32"
        elif name == "dropout_threshold":
            types[name] = "i64"
        else:
            types[name] = "i32"
    return types


def variants(quick: bool):
    """(label, kernel, constants, num_warps, num_stages, dtype), at the launch's own tile sizes.

    quick (for the test suite, where compile time counts): every feature
    switched on at once in 16 x 16 tiles (each code path of the kernels, in a
    tenth of the compile time), the causal kernels at the launch's tiles for
    D = 128 (the Hopper wgmma path), varlen, decoding and the two small kernels.
    """
    kinds = (
        ("forward", attention_forward, {}),
        ("dkdv", attention_backward_dkdv, {"BIAS_GRAD": 0}),
        ("dq", attention_backward_dq, {}),
    )
    if quick:
        blocks = {"BLOCK_D": 128, "BLOCK_DV": 128}
        for kind, kernel, extra in kinds:
            extra = {name: 1 for name in extra}  # BIAS_GRAD 1: the bias gradient's stores
            constants = {**ALL_FEATURES, **extra, **blocks, "PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 16}
            yield f"{kind} D=128 bf16 all features, 16x16", kernel, constants, 4, 1, "bf16"
        varlen = {**CAUSAL, "VARLEN": True, **blocks, "PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 16}
        yield "forward D=128 bf16 varlen causal, 16x16", attention_forward, varlen, 4, 1, "bf16"
    dims = [128] if quick else [64, 128, 256]
    feature_sets = {"causal": CAUSAL}
    if not quick:
        feature_sets = {"plain": NO_FEATURES} | feature_sets | {
            "all features": ALL_FEATURES,
            "varlen causal": CAUSAL | {"VARLEN": True},
        }  # fmt: skip
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        if quick and dtype == "fp32":
            continue
        for dim in dims:
            blocks = {"BLOCK_D": dim, "BLOCK_DV": dim}
            for label, features in feature_sets.items():
                flags = {**features, "PRECISION": precision}
                for kind, kernel, extra in kinds:
                    extra = {name: int(features["HAS_BIAS"]) for name in extra}
                    block_m, block_n, warps, stages = launch.gpu_tiles(kind, dim)
                    constants = {**flags, **extra, **blocks, "BLOCK_M": block_m, "BLOCK_N": block_n}
                    yield f"{kind} D={dim} {dtype} {label}", kernel, constants, warps, stages, dtype
            block_m, block_n, warps, stages = launch.gpu_tiles("decode", dim)
            constants = {
                **blocks, "BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": precision,
                "HAS_SOFTCAP": True, "HAS_ALIBI": True, "HAS_LEFT": True, "HAS_RIGHT": True,
                "PAGED": False, "PAGE_SIZE": 1,
            }  # fmt: skip
            yield f"decode D={dim} {dtype} all features", decode_split, constants, warps, stages, dtype
            paged = constants | {"PAGED": True, "PAGE_SIZE": 16}
            yield f"paged decode D={dim} {dtype} all features", decode_split, paged, warps, stages, dtype
    yield (
        "decode combine",
        decode_combine,
        {"BLOCK_S": 32, "BLOCK_DV": 128, "PRECISION": "tf32"},
        4,
        1,
        "bf16",
    )
    yield "combine in order", combine_in_order, {"BLOCK_DV": 128, "PRECISION": "tf32"}, 4, 1, "bf16"
    delta_constants = {"BLOCK_M": 64, "BLOCK_DV": 128, "HAS_DLSE": True, "VARLEN": False}
    yield "delta", attention_backward_delta, delta_constants, 4, 1, "bf16"


def resource_usage(cubin: bytes) -> str:
    tools = Path(triton.backends.nvidia.__file__).parent / "bin"
    path = Path(f"/tmp/flashformer-kernel-{os.getpid()}.cubin")
    path.write_bytes(cubin)
    try:
        out = subprocess.run(
            [tools / "cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True
        )
    except OSError:  # no cuobjdump beside ptxas in this Triton build
        return "resource usage unavailable"
    finally:
        path.unlink()
    for line in out.stdout.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
            return (
                f"regs {fields['REG']:>3}, stack (spills) {fields['STACK']:>4} B, local {fields['LOCAL']} B"
            )
    return "resource usage unavailable"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200) or 80 (A100)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="bf16, D = 128, every feature at once (8 kernels)"
    )
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for label, kernel, constants, warps, stages, dtype in variants(args.quick):
        started = time.perf_counter()
        try:
            compiled = triton.compile(
                ASTSource(kernel, signature(kernel, constants, dtype), constexprs=constants),
                target=target,
                options={"num_warps": warps, "num_stages": stages},
            )
        except Exception as error:  # report every variant, then fail
            failures += 1
            print(f"FAILED {label}: {type(error).__name__}: {str(error)[-2000:]}", flush=True)
            continue
        wgmma = "wgmma" in compiled.asm["ptx"]
        print(
            f"{label:<36} {resource_usage(compiled.asm['cubin'])}, shared {compiled.metadata.shared:>6} B, "
            f"{'wgmma' if wgmma else 'mma'}, {time.perf_counter() - started:4.1f} s",
            flush=True,
        )
    print(f"{failures} of the variants failed to compile for sm_{args.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
