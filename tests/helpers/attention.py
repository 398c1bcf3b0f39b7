"""Shared inputs and error measures for the attention tests.

The rule is flash-attn's: the reference is the eager backend in float64 on
the same inputs (rounded to dtype X first, so that the rounding of the inputs
themselves is no part of anyone's error); a backend run in X may be off from
it by at most twice what the eager backend run in X is off, plus 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import flashformer


@dataclass
class Shape:
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    dim: int
    dim_v: int | None = None

    def __str__(self) -> str:
        dv = "" if self.dim_v is None else f"v{self.dim_v}"
        return f"B{self.batch}H{self.q_heads}/{self.kv_heads}q{self.q_len}k{self.k_len}d{self.dim}{dv}"


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    kwargs: dict = field(default_factory=dict)


def make_inputs(shape: Shape, features: dict, seed: int = 0) -> Inputs:
    """float64 q, k, v, an upstream gradient, and attention() keyword arguments."""
    gen = torch.Generator().manual_seed(seed)
    B, Hq, Hk, Lq, Lk, D = shape.batch, shape.q_heads, shape.kv_heads, shape.q_len, shape.k_len, shape.dim
    Dv = shape.dim_v or D
    q = torch.randn(B, Hq, Lq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hk, Lk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hk, Lk, Dv, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(B, Hq, Lq, Dv, generator=gen, dtype=torch.float64)
    kwargs = {}
    for name, value in features.items():
        if name == "padding":
            lengths = torch.randint(max(1, Lk // 2), Lk + 1, (B,), generator=gen)
            kwargs["key_padding_mask"] = torch.arange(Lk)[None, :] < lengths[:, None]
        elif name == "mask":
            kwargs["mask"] = torch.rand(B, 1, Lq, Lk, generator=gen) > 0.3
        elif name == "bias":  # value: the bias' broadcast shape, with -1 for "full"
            full = (B, Hq, Lq, Lk)
            bias_shape = tuple(f if s == -1 else s for s, f in zip(value, full))
            kwargs["bias"] = torch.randn(bias_shape, generator=gen, dtype=torch.float64)
        elif name == "alibi":
            kwargs["alibi_slopes"] = torch.rand(Hq, generator=gen) * 0.5
        elif name == "dropout":
            kwargs["dropout_p"] = value
            kwargs["dropout_seed"] = 1234
        elif name in ("causal", "window", "softcap", "scale"):
            kwargs[name] = value
        else:
            raise KeyError(name)
    return Inputs(q, k, v, grad_out, kwargs)


def rounded_to(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    """The same inputs in float64, holding only values representable in dtype."""

    def rounded(t):
        return t.to(dtype).double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    kwargs = {name: rounded(value) for name, value in inputs.kwargs.items()}
    kwargs.pop("alibi_slopes", None)
    if "alibi_slopes" in inputs.kwargs:
        kwargs["alibi_slopes"] = inputs.kwargs["alibi_slopes"]  # slopes stay float32 in every run
    return Inputs(*(rounded(t) for t in (inputs.q, inputs.k, inputs.v, inputs.grad_out)), kwargs)


def run(inputs: Inputs, dtype: torch.dtype, backend: str, **extra):
    """Forward and backward in `dtype`; returns float64 (out, lse, dq, dk, dv, dbias)."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    kwargs = dict(inputs.kwargs)
    bias = kwargs.get("bias")
    if isinstance(bias, torch.Tensor):
        bias = bias.to(dtype).requires_grad_()
        kwargs["bias"] = bias
    want_lse = backend != "torch"
    result = flashformer.attention(q, k, v, backend=backend, return_lse=want_lse, **kwargs, **extra)
    out, lse = result if want_lse else (result, None)
    params = [q, k, v] + ([bias] if isinstance(bias, torch.Tensor) else [])
    grads = torch.autograd.grad(out, params, inputs.grad_out.to(dtype))
    dbias = grads[3].double() if len(grads) > 3 else None
    return (
        out.double(),
        None if lse is None else lse.double(),
        *(g.double() for g in grads[:3]),
        dbias,
    )


def max_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0
    both_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    return (a - b).masked_fill(both_inf, 0.0).abs().max().item()


NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def assert_within_budget(got, eager_low, reference, label: str, slack: float = 1e-5) -> None:
    """err(got) <= 2 * err(eager in the same dtype) + slack * max(1, max |reference|), for every
    output. The epsilon scales with the output's magnitude, as flash-attn's own epsilon term does
    (the reference's rounding at its size): float rounding is relative, and in float32, where
    eager's error is itself a few ulps, a fixed absolute epsilon judged a gradient of size 11
    (dk with dropout 0.3 and 16 x 32 tiles) by the rounding of values of size 1 (3.2e-5 against
    a budget of 3.0e-5 on an Intel Xeon's matmuls; an AMD EPYC's passed)."""
    for name, g, e, r in zip(NAMES, got, eager_low, reference):
        if g is None or r is None:
            continue
        assert torch.isfinite(g).logical_or(torch.isinf(r)).all(), f"{label}: {name} has NaN/inf"
        finite = r[torch.isfinite(r)]
        size = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
        err, budget = max_err(g, r), 2 * max_err(e, r) + slack * size
        assert err <= budget, f"{label}: {name} error {err:.3g} > budget {budget:.3g}"
