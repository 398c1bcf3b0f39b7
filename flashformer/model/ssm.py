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
  sqrt(L) vectorized steps, not L), in an autograd function whose backward (the same scan run
  backwards, the gradients written out) keeps h alone of the (B, L, d_inner, N) tensors;
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
from flashformer.model.short_conv import causal_conv1d

# ---- the scan ----


def _chunked_scan(a: Tensor, b: Tensor, reverse: bool = False) -> Tensor:
    """h_t = a_t h_(t-1) + b_t along dim 1 from h_(-1) = 0 (reverse: h_t = a_t h_(t+1) + b_t from
    h_L = 0), for every t, in 2 sqrt(L) vectorized steps instead of L: the sequence is cut into
    chunks of about sqrt(L) positions; (1) every chunk is scanned from a zero state, all chunks
    at once, keeping the running product of a; (2) the state entering each chunk is carried
    across the chunks; (3) it is added where it reaches, through that product. Only products
    of a (each in (0, 1]) and sums: no division, no log, exact to rounding whatever the decay.
    On the CPU it ran 3x faster than Hillis & Steele's log2(L) doubling steps (fewer passes
    over the (B, L, d_inner, N) tensors)."""
    batch, length, rest = a.shape[0], a.shape[1], a.shape[2:]
    chunk = math.isqrt(length - 1) + 1 if length > 1 else 1
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:  # b = 0 after the end: h stays 0 there (reverse), and nothing before it changes
        a = torch.cat((a, a.new_ones(batch, pad, *rest)), dim=1)
        b = torch.cat((b, b.new_zeros(batch, pad, *rest)), dim=1)
    a = a.reshape(batch, n_chunks, chunk, *rest)
    b = b.reshape(batch, n_chunks, chunk, *rest)
    h, decay = torch.empty_like(b), torch.empty_like(a)  # (B, n_chunks, chunk, ...)
    first, step = (chunk - 1, -1) if reverse else (0, 1)
    h[:, :, first], decay[:, :, first] = b[:, :, first], a[:, :, first]
    for t in range(first + step, chunk - 1 - first + step, step):  # (1)
        torch.addcmul(b[:, :, t], a[:, :, t], h[:, :, t - step], out=h[:, :, t])
        torch.mul(decay[:, :, t - step], a[:, :, t], out=decay[:, :, t])
    last = chunk - 1 - first  # each chunk's last position in the scan's direction
    entering = torch.empty_like(b[:, :, 0])  # (B, n_chunks, ...)
    start = n_chunks - 1 if reverse else 0
    entering[:, start] = 0
    for c in range(start + step, n_chunks - 1 - start + step, step):  # (2)
        previous = c - step
        torch.addcmul(
            h[:, previous, last], decay[:, previous, last], entering[:, previous], out=entering[:, c]
        )
    h.addcmul_(decay, entering[:, :, None])  # (3)
    return h.reshape(batch, n_chunks * chunk, *rest)[:, :length]


class _SelectiveScan(torch.autograd.Function):
    """selective_scan's y and last state, with a backward written out so that training keeps
    one (B, L, d_inner, N) tensor (h) instead of autograd's several. With Ā = exp(Δ A),
    g_t = dL/dh_t (through y and the later states: the same recurrence run backwards,
    g_t = C_t dy_t + Ā_(t+1) g_(t+1)) and G = g h_(t-1) Ā (the gradient of Δ A):
    dC_t = dy_t · h_t, dB_t = Σ_c g Δ u, d(Δ u) = Σ_n g B, dΔ = Σ_n G A + d(Δ u) u,
    dA = Σ_(b,t) G Δ, dh0 = g_0 Ā_0."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, h0):
        decay = torch.exp(delta[..., None] * A)  # Ā: (B, L, d_inner, N)
        drive = (delta * u)[..., None] * B[:, :, None, :]  # B̄ u: (B, L, d_inner, N)
        if h0 is not None:  # h_0 = Ā_0 h0 + B̄_0 u_0: the state enters through the first drive
            drive[:, 0] += decay[:, 0] * h0
        h = _chunked_scan(decay, drive)  # (B, L, d_inner, N)
        y = torch.einsum("bldn,bln->bld", h, C) + D * u  # (B, L, d_inner)
        ctx.save_for_backward(u, delta, A, B, C, D, h0, h)
        return y, h[:, -1].clone()

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        u, delta, A, B, C, D, h0, h = ctx.saved_tensors
        decay = torch.exp(delta[..., None] * A)
        grad_h = grad_y[..., None] * C[:, :, None, :]  # through y: (B, L, d_inner, N)
        if grad_last is not None:
            grad_h[:, -1] += grad_last
        decay_next = torch.cat((decay[:, 1:], torch.zeros_like(decay[:, :1])), dim=1)  # Ā_(t+1)
        g = _chunked_scan(decay_next, grad_h, reverse=True)  # dL/dh_t
        start = torch.zeros_like(h[:, :1]) if h0 is None else h0[:, None]
        h_before = torch.cat((start, h[:, :-1]), dim=1)  # h_(t-1)
        grad_log_decay = g * h_before * decay  # dL/d(Δ A): (B, L, d_inner, N)
        grad_delta_u = torch.einsum("bldn,bln->bld", g, B)
        grad_delta = torch.einsum("bldn,dn->bld", grad_log_decay, A) + grad_delta_u * u
        return (
            grad_delta_u * delta + grad_y * D,  # u
            grad_delta,
            torch.einsum("bldn,bld->dn", grad_log_decay, delta),  # A
            torch.einsum("bldn,bld->bln", g, delta * u),  # B
            torch.einsum("bld,bldn->bln", grad_y, h),  # C
            (grad_y * u).sum(dim=(0, 1)),  # D
            None if h0 is None else g[:, 0] * decay[:, 0],  # h0
        )


def selective_scan(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, h0: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The parallel form: u, delta (B, L, d_inner); A (d_inner, N); B, C (B, L, N); D (d_inner,);
    h0 (B, d_inner, N) the state before the first position, or None (zeros).
    Returns y (B, L, d_inner) and the last state h_(L-1) (B, d_inner, N)."""
    return _SelectiveScan.apply(u, delta, A, B, C, D, h0)


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
        # depthwise, padded by the state: short_conv.causal_conv1d, as LFM2's conv layers
        self.conv = nn.Conv1d(inner, inner, config.ssm_conv, groups=inner)
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
        conv, conv_state = causal_conv1d(  # (B, d_inner, L): causal, continued from the state
            u.transpose(1, 2), self.conv.weight, self.conv.bias, None if state is None else state["conv"]
        )
        u = F.silu(conv).transpose(1, 2)  # (B, L, d_inner)
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
            state.advance(length, conv=conv_state, ssm=h)
        out = self.out_proj(y.to(z.dtype) * F.silu(z))  # (B, L, d_model)
        return x + self.dropout(out)


class SSMModel(RecurrentLanguageModel):
    """A Mamba-style language model (arch "ssm"): n_layers MambaBlocks, a final norm, a tied head."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, "ssm", MambaBlock, make_norm(config))
