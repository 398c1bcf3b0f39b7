"""A selective state-space language model in the style of Mamba (arch "ssm").

The formulation followed is Mamba-1's selective SSM ("S6") and block, Gu & Dao 2023, "Mamba:
Linear-Time Sequence Modeling with Selective State Spaces" (Section 3, Algorithm 2, Figure 3),
with the simplifications of its reference implementation. For each of the d_inner channels c
and the N state entries n, with the input u_t (B, L, d_inner) after the block's conv:

    Δ_t = softplus(W_Δ (W_r u_t) + b_Δ)          (B, L, d_inner)  the input-dependent step size
    B_t = W_B u_t,  C_t = W_C u_t                 (B, L, N)        input-dependent, shared by channels
    A = -exp(A_log)                               (d_inner, N)     diagonal, real, negative
    Ā_t = exp(Δ_t A)                              zero-order hold of A
    B̄_t u_t = Δ_t B_t u_t                        ZOH's B̄ = (ΔA)^-1 (exp(ΔA) - I) ΔB to first
                                                  order in Δ, as the paper's code does
    h_t = Ā_t h_(t-1) + B̄_t u_t,   y_t = C_t · h_t + D u_t

The block (Figure 3): x -> norm -> in_proj to (u, z) -> causal depthwise conv1d(u) -> SiLU
-> the SSM above -> y * SiLU(z) -> out_proj, added to x. A model is n_layers such blocks
between the token table and a final norm, with a tied head (Mamba's MixerModel).

Two forms of the same recurrence:
- parallel (training, prefill): `selective_scan` computes every h_t with a chunked scan (about
  sqrt(L) positions per chunk, all chunks at once, then the states carried across chunks: 2
  sqrt(L) vectorized steps, not L), in an autograd function whose backward is the same scan
  run backwards, so training keeps only Ā, h and the small inputs, not the scan's steps;
- recurrent (decoding): `selective_step` advances h by one token; with the conv's last
  ssm_conv - 1 inputs it is the whole RecurrentState, (B, d_inner, ssm_conv - 1 + N) numbers
  per layer whatever the number of tokens seen.
The scan runs in float32 (float64 for float64 inputs) whatever the autocast dtype.
Mamba's fused CUDA kernel, which keeps h in SRAM instead of writing (B, L, d_inner, N) to
memory, is not reproduced: this is the readable PyTorch form.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.generate.cache import RecurrentState
from flashformer.kernels.cpu import Linear
from flashformer.model.config import ModelConfig
from flashformer.model.layers import make_norm
from flashformer.model.recurrent import RecurrentLanguageModel

# ---- the scan ----


def _chunked_scan(a: Tensor, b: Tensor) -> Tensor:
    """h_t = a_t h_(t-1) + b_t along dim 1, h_(-1) = 0, for every t, in 2 sqrt(L) vectorized
    steps instead of L: the sequence is cut into chunks of about sqrt(L) positions; (1) every
    chunk is scanned from a zero state, all chunks at once; (2) the state entering each chunk
    is carried across the chunks; (3) it is added where it reaches, through the cumulative
    product of a inside the chunk. Only products of a (each in (0, 1]) and sums: no division,
    no log, so it is exact to rounding whatever the decay (a log-space cumulative sum would
    underflow once Δ A sums below float32's exp range). On the CPU it ran 3x faster than
    Hillis & Steele's log2(L) doubling steps (fewer passes over the (B, L, d_inner, N) tensors)."""
    batch, length, rest = a.shape[0], a.shape[1], a.shape[2:]
    chunk = math.isqrt(length - 1) + 1 if length > 1 else 1
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:  # a = 1, b = 0 after the end change nothing before it
        a = torch.cat((a, a.new_ones(batch, pad, *rest)), dim=1)
        b = torch.cat((b, b.new_zeros(batch, pad, *rest)), dim=1)
    a = a.reshape(batch, n_chunks, chunk, *rest)
    b = b.reshape(batch, n_chunks, chunk, *rest)
    h = torch.empty_like(b)  # (B, n_chunks, chunk, ...)
    h[:, :, 0] = b[:, :, 0]
    for t in range(1, chunk):  # (1)
        torch.addcmul(b[:, :, t], a[:, :, t], h[:, :, t - 1], out=h[:, :, t])
    decay = torch.cumprod(a, dim=2)  # a_first .. a_t inside each chunk
    entering = torch.empty_like(b[:, :, 0])  # (B, n_chunks, ...)
    entering[:, 0] = 0
    for c in range(1, n_chunks):  # (2)
        torch.addcmul(h[:, c - 1, -1], decay[:, c - 1, -1], entering[:, c - 1], out=entering[:, c])
    h.addcmul_(decay, entering[:, :, None])  # (3)
    return h.reshape(batch, n_chunks * chunk, *rest)[:, :length]


class _LinearScan(torch.autograd.Function):
    """h = scan(a, b) (a, b: (B, L, ...)); backward: with g_t = dL/dh_t + a_(t+1) g_(t+1) (the
    same recurrence, backwards), dL/db_t = g_t and dL/da_t = g_t h_(t-1)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        h = _chunked_scan(a, b)
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, grad_h: Tensor):
        a, h = ctx.saved_tensors
        a_next = torch.cat((a[:, 1:], torch.zeros_like(a[:, :1])), dim=1)  # a_(t+1), 0 after the end
        g = _chunked_scan(a_next.flip(1), grad_h.flip(1)).flip(1)
        h_before = torch.cat((torch.zeros_like(h[:, :1]), h[:, :-1]), dim=1)  # h_(t-1)
        return g * h_before, g


def selective_scan(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, h0: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The parallel form: u, delta (B, L, d_inner); A (d_inner, N); B, C (B, L, N); D (d_inner,);
    h0 (B, d_inner, N) the state before the first position, or None (zeros).
    Returns y (B, L, d_inner) and the last state h_(L-1) (B, d_inner, N)."""
    decay = torch.exp(delta[..., None] * A)  # Ā: (B, L, d_inner, N)
    drive = (delta * u)[..., None] * B[:, :, None, :]  # B̄ u: (B, L, d_inner, N)
    if h0 is not None:  # h_0 = Ā_0 h0 + B̄_0 u_0: the state enters through the first drive
        drive = torch.cat((drive[:, :1] + decay[:, :1] * h0[:, None], drive[:, 1:]), dim=1)
    h = _LinearScan.apply(decay, drive)  # (B, L, d_inner, N)
    y = torch.einsum("bldn,bln->bld", h, C) + D * u  # (B, L, d_inner)
    return y, h[:, -1]


def selective_step(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, h: Tensor
) -> tuple[Tensor, Tensor]:
    """The recurrent form, one position: u, delta (B, d_inner); B, C (B, N); h (B, d_inner, N).
    Returns y (B, d_inner) and the next state."""
    h = torch.exp(delta[..., None] * A) * h + (delta * u)[..., None] * B[:, None, :]  # (B, d_inner, N)
    return torch.einsum("bdn,bn->bd", h, C) + D * u, h


# ---- the block ----


class MambaBlock(nn.Module):
    """x + out_proj(SSM(SiLU(conv(u))) * SiLU(z)), (u, z) = in_proj(norm(x)); see the module
    docstring. State: "conv" (B, d_inner, ssm_conv - 1), the conv's last inputs; "ssm"
    (B, d_inner, N), h."""

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__()
        d, inner, n = config.d_model, config.ssm_expand * config.d_model, config.ssm_state
        self.inner, self.n_state, self.dt_rank, self.width = inner, n, config.ssm_dt_rank, config.ssm_conv
        self.depth = config.n_layers
        self.norm = make_norm(config)
        self.in_proj = Linear(d, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, config.ssm_conv, groups=inner)  # depthwise; padded by the state
        self.x_proj = Linear(inner, config.ssm_dt_rank + 2 * n, bias=False)
        self.dt_proj = Linear(config.ssm_dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, n))
        self.D = nn.Parameter(torch.empty(inner))
        self.out_proj = Linear(inner, d, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def reset_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """Mamba's initialization: A = -(1, 2, .., N) in every channel (S4D-real), D = 1, the
        step size's bias such that softplus(bias) is log-uniform in [dt_min, dt_max], dt_proj's
        weight U(±dt_rank^-1/2); PyTorch's defaults elsewhere, out_proj divided by
        sqrt(n_layers) (the residual stream's variance does not grow with depth)."""
        for module in (self.in_proj, self.conv, self.x_proj, self.out_proj):
            module.reset_parameters()
        with torch.no_grad():
            self.out_proj.weight.div_(math.sqrt(self.depth))
            self.A_log.copy_(
                torch.log(torch.arange(1, self.n_state + 1, dtype=torch.float32)).expand_as(self.A_log)
            )
            self.D.fill_(1.0)
            nn.init.uniform_(self.dt_proj.weight, -(self.dt_rank**-0.5), self.dt_rank**-0.5)
            dt = torch.exp(torch.rand(self.inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> RecurrentState:
        scan_dtype = torch.promote_types(dtype, torch.float32)
        return RecurrentState(
            conv=torch.zeros(batch, self.inner, self.width - 1, dtype=dtype, device=device),
            ssm=torch.zeros(batch, self.inner, self.n_state, dtype=scan_dtype, device=device),
        )

    def forward(self, x: Tensor, state: RecurrentState | None) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model); the state, if given, is read and advanced
        (one token: the recurrent step; more: the parallel scan from the state)."""
        batch, length, _ = x.shape
        u, z = self.in_proj(self.norm(x)).chunk(2, dim=-1)  # (B, L, d_inner) each
        u = u.transpose(1, 2)  # (B, d_inner, L)
        before = (
            u.new_zeros(batch, self.inner, self.width - 1) if state is None else state["conv"].to(u.dtype)
        )
        window = torch.cat((before, u), dim=2)  # (B, d_inner, width - 1 + L)
        u = F.silu(self.conv(window)).transpose(1, 2)  # (B, L, d_inner): causal, continued from the state
        dt, B, C = self.x_proj(u).split((self.dt_rank, self.n_state, self.n_state), dim=-1)
        delta = F.softplus(self.dt_proj(dt))  # (B, L, d_inner)

        scan_dtype = torch.promote_types(u.dtype, torch.float32)
        A = -torch.exp(self.A_log.to(scan_dtype))  # (d_inner, N)
        inputs = [t.to(scan_dtype) for t in (u, delta)] + [A] + [t.to(scan_dtype) for t in (B, C)]
        D = self.D.to(scan_dtype)
        if state is not None and length == 1:
            y, h = selective_step(*(t[:, 0] if t.dim() == 3 else t for t in inputs), D, state["ssm"])
            y = y[:, None]  # (B, 1, d_inner)
        else:
            y, h = selective_scan(*inputs, D, None if state is None else state["ssm"])
        if state is not None:
            state.advance(length, conv=window[:, :, window.shape[2] - (self.width - 1) :], ssm=h)
        out = self.out_proj(y.to(z.dtype) * F.silu(z))  # (B, L, d_model)
        return x + self.dropout(out)


class SSMModel(RecurrentLanguageModel):
    """A Mamba-style language model (arch "ssm"): n_layers MambaBlocks, a final norm, a tied head."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, "ssm", MambaBlock, make_norm(config))
