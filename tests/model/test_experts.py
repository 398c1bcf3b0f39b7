"""model/experts.py's MixtureOfExperts against a float64 reference that runs every expert on
every row and keeps the top-k by a mask; and what it runs: only the chosen experts, each at
most once per call."""

from __future__ import annotations

import pytest
import torch

from flashformer.model.experts import MixtureOfExperts
from flashformer.model.presets import preset


def moe(weights_norm: bool, seed: int = 0) -> MixtureOfExperts:
    config = preset(
        "llama-tiny",
        n_expert=8,
        n_expert_used=3,
        expert_ffn_hidden=24,
        ffn_bias=False,
        expert_weights_norm=weights_norm,
    )
    torch.manual_seed(seed)
    module = MixtureOfExperts(config)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
    return module.eval()


def dense_reference(module: MixtureOfExperts, x: torch.Tensor, weights_norm: bool) -> torch.Tensor:
    """Every expert on every row in float64; the top-k kept by a 0/1 mask over the experts."""
    rows = x.reshape(-1, x.shape[-1]).double()  # (N, d)
    probs = torch.softmax(rows @ module.router.weight.double().T, dim=-1)  # (N, E)
    kth = probs.sort(dim=-1, descending=True).values[:, module.n_expert_used - 1 : module.n_expert_used]
    kept = probs * (probs >= kth)  # (N, E): the top-k probabilities, zeros elsewhere
    if weights_norm:
        kept = kept / kept.sum(dim=-1, keepdim=True)
    outputs = []
    for expert in module.experts:
        gate, up, down = (expert.gate.weight.double(), expert.up.weight.double(), expert.down.weight.double())
        outputs.append((torch.nn.functional.silu(rows @ gate.T) * (rows @ up.T)) @ down.T)  # (N, d)
    out = torch.einsum("ne,end->nd", kept, torch.stack(outputs))  # (N, d)
    return out.view(x.shape)


@pytest.mark.parametrize("weights_norm", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 7, 64)])
def test_equals_the_dense_float64_reference(weights_norm, shape):
    module = moe(weights_norm)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = module(x)
    expected = dense_reference(module, x, weights_norm)
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


def test_only_the_chosen_experts_run_each_once():
    module = moe(True)
    calls = []
    for index, expert in enumerate(module.experts):
        expert.register_forward_hook(lambda m, args, out, index=index: calls.append((index, len(args[0]))))
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        module(x)
        _, chosen = module.route(x.view(1, 64))
    assert sorted(index for index, _ in calls) == sorted(chosen[0].tolist())  # a decode step: k experts
    calls.clear()
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(3))  # 64 rows
    with torch.no_grad():
        module(x)
    experts = [index for index, _ in calls]
    assert len(experts) == len(set(experts))  # each expert once, over all the rows that chose it
    assert sum(rows for _, rows in calls) == 64 * module.n_expert_used


def test_trains_and_runs_under_autocast():
    """The gradient reaches the router (through the chosen experts' weights) and the experts
    chosen; under bfloat16 autocast the experts' bf16 outputs add into the float32 rows."""
    module = moe(True).train()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    module(x).square().sum().backward()
    assert module.router.weight.grad.abs().sum() > 0
    _, chosen = module.route(x.view(-1, 64))
    for index, expert in enumerate(module.experts):
        ran = bool((chosen == index).any())
        assert (expert.down.weight.grad is not None and expert.down.weight.grad.abs().sum() > 0) == ran
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = module.eval()(x)
    assert low.dtype == torch.float32
    exact = module(x).detach()
    # bfloat16 keeps 8 bits of each product's mantissa (seen: 0.6% of the largest output)
    assert (low - exact).abs().max() < 2**-6 * exact.abs().max()
