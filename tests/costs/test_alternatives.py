"""The alternatives' cost formulas (costs/alternatives.py) against FlopCounterMode and against
the tensors decoding keeps: a forward pass and a decode step of every family, the windowed
pair counts against brute force, the decoding memory against the states' and caches' bytes."""

from __future__ import annotations

import pytest
import torch
from helpers import flop_counter

from flashformer.costs import alternatives
from flashformer.generate.cache import make_caches
from flashformer.model.models import build
from flashformer.model.presets import preset

SIZES = dict(d_model=32, n_layers=2, n_heads=4, d_ff=64, vocab_size=50)
CONFIGS = {
    "lstm": lambda: preset("lstm-tiny", **SIZES),
    "gru": lambda: preset("gru-tiny", **SIZES),
    "ssm": lambda: preset("mamba-tiny", **SIZES),
    "linear-elu": lambda: preset("llama-tiny", **SIZES, n_kv_heads=2, attention_kind="linear"),
    "linear-favor": lambda: preset(
        "llama-tiny",
        **SIZES,
        n_kv_heads=2,
        attention_kind="linear",
        linear_feature_map="favor",
        linear_features=12,
    ),
    "windowed": lambda: preset(
        "llama-tiny",
        **SIZES,
        n_kv_heads=2,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=5,
        global_tokens=2,
        attention_backend="flash",
    ),
    "hybrid": lambda: preset(
        "llama-tiny",
        **dict(SIZES, n_layers=3),
        n_kv_heads=2,
        qk_norm=True,
        layer_types=("conv", "full_attention", "conv"),
        short_conv_kernel=4,
        attention_backend="flash",
    ),
}


def counted(model, ids, **kwargs) -> int:
    counter = flop_counter()
    # nn.LSTM's oneDNN kernel hides its matmuls from the counter; without it, the same products
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False), counter:
        model(ids, **kwargs)
    return counter.get_total_flops()


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch's notice when oneDNN's flags are set
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_and_decode_step_flops_match_the_counter(name):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = build(config).eval()
    for n in (6, 40):
        ids = torch.randint(0, 50, (2, n + 1))
        assert counted(model, ids[:, :n]) == sum(alternatives.forward_flops(config, 2, n).values()), n
        caches = make_caches(model, 2, n + 1)
        with torch.no_grad():
            model(ids[:, :n], kv_caches=caches)
        step = counted(model, ids[:, n:], kv_caches=caches, cache_position=n)
        assert step == sum(alternatives.forward_flops(config, 2, 1, cache_len=n).values()), n


def test_the_transformer_formulas_refuse_a_hybrid_by_name():
    from flashformer.costs import estimate

    with pytest.raises(ValueError, match=r"conv layers \(LFM2's short convolutions.*costs\.alternatives"):
        estimate(CONFIGS["hybrid"](), 16)
    hybrid, dense = CONFIGS["hybrid"](), CONFIGS["hybrid"]().replace(layer_types=None)
    # two conv layers keep 3 inputs of 32 channels where attention keeps 2 x 2 heads x 8 per token
    assert (
        alternatives.decode_memory_bytes(hybrid, 1, 1000)
        < alternatives.decode_memory_bytes(dense, 1, 1000) / 2
    )


@pytest.mark.parametrize("name", ["lstm", "gru", "ssm", "linear-elu"])
def test_a_recurrent_step_costs_the_same_after_any_number_of_tokens(name):
    config = CONFIGS[name]()
    steps = {n: sum(alternatives.forward_flops(config, 1, 1, cache_len=n).values()) for n in (10, 10_000)}
    memory = {n: alternatives.decode_memory_bytes(config, 1, n) for n in (10, 10_000)}
    assert steps[10] == steps[10_000] and memory[10] == memory[10_000]
    windowed = CONFIGS["windowed"]()
    assert alternatives.decode_memory_bytes(windowed, 1, 10_000) == 1000 * alternatives.decode_memory_bytes(
        windowed, 1, 10
    )  # the static KV cache keeps every position
    assert alternatives.window_bound_bytes(windowed, 1, 10_000) < alternatives.decode_memory_bytes(
        windowed, 1, 10_000
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_memory_equals_the_bytes_of_the_states_or_caches(name):
    config = CONFIGS[name]()
    model = build(config).eval()
    caches = make_caches(model, 3, 40)
    held = sum(c.nbytes if hasattr(c, "nbytes") else c.k.nbytes + c.v.nbytes for c in caches)
    assert held == alternatives.decode_memory_bytes(config, 3, 40)


@pytest.mark.parametrize(
    "q_len, k_len, window, global_tokens, causal",
    [(40, 40, 6, 3, True), (9, 30, 4, 2, True), (25, 25, 3, 2, False)],
)
def test_windowed_pair_counts_against_brute_force(q_len, k_len, window, global_tokens, causal):
    i = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None, :]
    band = (j > i - window) & ((j <= i) if causal else (j < i + window))
    reach = (j < global_tokens) | (i < global_tokens)
    allowed = band | (reach & (j <= i) if causal else reach)
    exact = alternatives.windowed_pairs(q_len, k_len, window, global_tokens, causal, "exact")
    assert exact == int(allowed.sum())
    flash = alternatives.windowed_pairs(q_len, k_len, window, global_tokens, causal, "flash")
    assert exact <= flash <= q_len * k_len


def test_flashformer_cost_prints_the_alternatives_table(tmp_path, capsys):
    from flashformer.cli.commands import main

    main(["cost", "mamba-mini", "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert "ssm" in out and "| 16384 |" in out and (tmp_path / "cost.json").is_file()
