"""The cost formulas against measurement.

FLOPs: torch.utils.flop_counter.FlopCounterMode counts the matmuls a model
actually runs (forward, training step, decode step), total and per group.
Memory: parameters and optimizer state against the tensors themselves;
activations against what autograd saves (saved_tensors_hooks, storage by
storage).

FlopCounterMode does not count in-place matmuls (baddbmm_, which the flash
backend accumulates with), so the counter is taught that one formula: the
same as baddbmm's. Nothing else is added to it.
"""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from helpers import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import flashformer
from flashformer import costs
from flashformer.costs.flops import GROUPS, attention_pairs, flash_backward_pairs
from flashformer.model.config import RECURRENT_ARCHS
from flashformer.model.presets import PRESETS

FULL_PRESETS = ["bert-base", "gpt2", "t5-small", "llama-small"]
# the recurrent alternatives have formulas of their own (test_alternatives.py)
TINY_PRESETS = sorted(
    n for n in set(PRESETS) - set(FULL_PRESETS) if PRESETS[n].get("arch") not in RECURRENT_ARCHS
)


def counted_groups(counter: FlopCounterMode) -> dict[str, int]:
    """The counter's FLOPs in the estimate's four groups, by module name."""
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}

    def matching(pattern: str) -> int:
        return sum(value for name, value in counts.items() if re.search(pattern, name))

    projections = matching(r"\.(attn\.(qkv|out)|cross_attn\.(q|kv|out))$")
    attention = matching(r"\.(attn|cross_attn)$") - projections
    ffn = matching(r"\.ffn$")
    head = counts["Global"] - projections - attention - ffn
    return dict(zip(GROUPS, (projections, attention, ffn, head)))


def model_inputs(model, batch: int, seq_len: int, decoder_len: int | None = None, labels: bool = False):
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (batch, seq_len))
    kwargs = {}
    if model.config.arch == "encoder-decoder":
        decoder_ids = torch.randint(2, vocab, (batch, decoder_len or seq_len))
        kwargs["labels" if labels else "decoder_input_ids"] = decoder_ids
    elif labels:
        kwargs["labels"] = ids.clone()  # a storage of its own, as a real batch's labels
    return ids, kwargs


def build(name: str, backend: str, seq_len: int, **overrides):
    config = PRESETS[name]
    max_len = max(config.get("max_seq_len", 1024), seq_len)
    torch.manual_seed(0)
    return flashformer.build(name, attention_backend=backend, max_seq_len=max_len, **overrides)


def assert_same_flops(counted: int, predicted: int, what: str) -> None:
    error = abs(counted - predicted) / counted
    assert error <= 0.01, f"{what}: FlopCounterMode {counted:,} vs formula {predicted:,} ({error:.2%})"
    assert counted == predicted, f"{what}: FlopCounterMode {counted:,} vs formula {predicted:,} (not exact)"


# ---- forward ----


@pytest.fixture(scope="module", params=FULL_PRESETS)
def full_model(request):
    """A full-size preset with zero weights: the matmuls are the same, and
    nothing is spent on random initialization."""
    with torch.device("meta"):
        model = flashformer.build(request.param, attention_backend="eager")
    model = model.to_empty(device="cpu")
    for parameter in model.parameters():
        parameter.detach().zero_()
    for module in model.modules():  # RoPE frequencies, ALiBi slopes
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return request.param, model.eval()


@pytest.mark.parametrize("seq_len", [16, 128])
def test_forward_flops_of_full_presets_match_the_counter(full_model, seq_len):
    name, model = full_model
    ids, kwargs = model_inputs(model, 1, seq_len)
    counter = flop_counter()
    with counter, torch.no_grad():
        model(ids, **kwargs)
    est = costs.estimate(name, seq_len, attention="eager")
    assert_same_flops(counter.get_total_flops(), est.forward_flops, f"{name}, n={seq_len}")
    for group, value in counted_groups(counter).items():
        assert_same_flops(value, est.grouped_flops()[group], f"{name}, n={seq_len}, {group}")


@pytest.mark.parametrize("backend", ["eager", "flash"])
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_forward_flops_of_tiny_presets_match_the_counter(name, backend):
    """Lengths of one, one partial and three flash tiles (256 wide), batch 2;
    flash skips the tiles above the diagonal."""
    for seq_len in (1, 130, 520):
        model = build(name, backend, seq_len).eval()
        ids, kwargs = model_inputs(model, 2, seq_len, decoder_len=max(1, seq_len // 3))
        counter = flop_counter()
        with counter, torch.no_grad():
            model(ids, **kwargs)
        decoder_len = max(1, seq_len // 3) if model.config.arch == "encoder-decoder" else None
        est = costs.estimate(model.config, seq_len, batch=2, decoder_len=decoder_len, attention=backend)
        assert_same_flops(counter.get_total_flops(), est.forward_flops, f"{name} {backend}, n={seq_len}")
        for group, value in counted_groups(counter).items():
            assert_same_flops(value, est.grouped_flops()[group], f"{name} {backend}, n={seq_len}, {group}")


# ---- training step ----


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("backend", ["eager", "flash"])
@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "t5-tiny", "llama-tiny"])
def test_train_step_flops_match_the_counter(name, backend, checkpointing):
    seq_len = 260  # two flash tiles: the backward skips one of the four
    model = build(name, backend, seq_len, activation_checkpointing=checkpointing).train()
    ids, kwargs = model_inputs(model, 2, seq_len, decoder_len=90, labels=True)
    counter = flop_counter()
    with counter:
        model(ids, **kwargs).loss.backward()
    decoder_len = 90 if model.config.arch == "encoder-decoder" else None
    est = costs.estimate(model.config, seq_len, batch=2, decoder_len=decoder_len, attention=backend)
    what = f"{name} {backend}, checkpointing={checkpointing}"
    assert_same_flops(counter.get_total_flops(), est.train_step_flops, what)
    ratio = est.train_step_flops / est.forward_flops
    if not checkpointing and backend == "eager":
        assert ratio == 3.0 or name == "bert-tiny", (
            f"{what}: train / forward = {ratio}"
        )  # pooler: no backward


# ---- decode step ----


class ConcatCache:
    """The smallest KV cache the attention layer accepts (see layers.py): it appends."""

    def __init__(self):
        self.k = self.v = None

    def update(self, k, v, cache_position):
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        assert self.k.shape[2] == cache_position + k.shape[2]
        return self.k, self.v


@pytest.mark.parametrize("backend", ["eager", "flash"])
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_decode_step_flops_match_the_counter(name, backend):
    batch, prompt = 2, 90
    model = build(name, backend, 512).eval()
    caches = [ConcatCache() for _ in range(model.config.n_layers)]
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt + 1))
    with torch.no_grad():
        model(ids[:, :prompt], kv_caches=caches)
        counter = flop_counter()
        with counter:
            model(ids[:, prompt:], kv_caches=caches, cache_position=prompt)
    est = costs.estimate(model.config, 16, cache_len=prompt, batch=batch)
    assert_same_flops(
        counter.get_total_flops(), est.decode_step_flops, f"{name} {backend} decode after {prompt}"
    )


# ---- the KV cache ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [n for n in TINY_PRESETS if flashformer.preset(n).arch != "encoder"])
def test_kv_cache_bytes_equal_the_cache_tensors(name, dtype):
    """The formula against flashformer.generate.cache's own tensors after a prefill
    (T5's cross-attention keys and values included), byte for byte."""
    from flashformer.generate.cache import make_caches

    batch, prompt, new_tokens = 3, 11, 5
    model = build(name, "flash", 64).eval().to(dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (batch, prompt))
    with torch.no_grad():
        if model.config.arch == "encoder-decoder":
            caches = make_caches(model, batch, new_tokens)
            start = torch.zeros(batch, 1, dtype=torch.long)
            model(input_ids=ids, decoder_input_ids=start, kv_caches=caches)
            cache_len, memory_len = new_tokens, prompt
        else:
            caches = make_caches(model, batch, prompt + new_tokens)
            model(ids, kv_caches=caches)
            cache_len, memory_len = prompt + new_tokens, 0
    self_bytes = sum(c.k.nbytes + c.v.nbytes for c in caches)
    cross_bytes = sum(sum(t.nbytes for t in c.memory_kv) for c in caches if c.memory_kv is not None)
    est = costs.estimate(
        model.config,
        memory_len or 16,
        cache_len=cache_len,
        batch=batch,
        dtype=str(dtype).removeprefix("torch."),
    )
    assert est.kv_cache_self_bytes == self_bytes
    assert est.kv_cache_cross_bytes == cross_bytes
    assert est.kv_cache_bytes == self_bytes + cross_bytes


# ---- the pair counts behind the attention FLOPs ----


def test_pair_counts_against_brute_force():
    for q_len, k_len in ((1, 1), (1, 700), (5, 5), (256, 256), (257, 300), (600, 600), (300, 900)):
        i = torch.arange(q_len)[:, None] + (k_len - q_len)
        allowed = (torch.arange(k_len)[None, :] <= i).sum().item()
        assert attention_pairs(q_len, k_len, True, "exact") == allowed
        assert attention_pairs(q_len, k_len, True, "eager") == q_len * k_len
        assert attention_pairs(q_len, k_len, False, "flash") == q_len * k_len
        flash = attention_pairs(q_len, k_len, True, "flash")
        assert allowed <= flash <= q_len * k_len
        assert allowed <= flash_backward_pairs(q_len, k_len, True) <= q_len * k_len
    # one tile: flash computes the whole square; many tiles: about half
    assert attention_pairs(256, 256, True, "flash") == 256 * 256
    assert attention_pairs(4096, 4096, True, "flash") == 256 * 256 * 16 * 17 // 2


# ---- memory ----


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_the_built_model(name):
    with torch.device("meta"):
        model = flashformer.build(name)
    assert costs.parameter_count(model.config) == model.num_parameters()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(share_layers=True),
        dict(tie_word_embeddings=False),
        dict(n_kv_heads=1, attention_bias=False, ffn_bias=False),
        dict(gated_ffn=True, norm="rmsnorm", position="rope"),
        dict(head_dim=24, position="alibi"),
    ],
)
@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "t5-tiny"])
def test_parameter_count_of_variants(name, overrides):
    with torch.device("meta"):
        model = flashformer.build(name, **overrides)
    assert costs.parameter_count(model.config) == model.num_parameters()


def test_optimizer_state_matches_adamw():
    model = flashformer.build("llama-tiny")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    moments = sum(
        state[key].nbytes for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")
    )
    est = costs.estimate("llama-tiny", 16)
    assert est.optimizer_bytes == moments
    assert est.gradient_bytes == sum(p.grad.nbytes for p in model.parameters())
    assert est.weight_bytes == sum(p.nbytes for p in model.parameters())


def saved_bytes(model, ids, kwargs) -> int:
    """Bytes of the distinct non-parameter storages that autograd still holds
    for the loss's backward once the forward is over (tensors saved on
    branches the loss does not reach die with their outputs)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []

    def pack(t):
        # a detached alias: the graph holds it, and it holds no graph (a saved
        # output returned as is would keep its own node alive in a cycle)
        alias = t.detach()
        packed.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, **kwargs).loss  # the ModelOutput (logits, pooler output) is dropped here
    gc.collect()
    storages = {}
    for ref in packed:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in parameters:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert loss.grad_fn is not None
    return sum(storages.values())


@pytest.mark.parametrize("backend", ["eager", "flash"])
@pytest.mark.parametrize("name", TINY_PRESETS)
def test_activation_bytes_match_what_autograd_saves(name, backend):
    for batch, seq_len in ((1, 64), (2, 300)):
        model = build(name, backend, seq_len).train()
        ids, kwargs = model_inputs(model, batch, seq_len, decoder_len=seq_len // 2, labels=True)
        decoder_len = seq_len // 2 if model.config.arch == "encoder-decoder" else None
        est = costs.estimate(model.config, seq_len, batch=batch, decoder_len=decoder_len)
        measured = saved_bytes(model, ids, kwargs)
        predicted = est.activations[backend].total
        assert predicted == measured, (
            f"{name} {backend} B={batch} n={seq_len}: saved {measured:,} bytes, formula {predicted:,} "
            f"({predicted - measured:+,})"
        )


# ---- one attention call's peak memory, against the benchmark ----


def benchmark_peak(backend: str, n: int) -> dict[str, int]:
    """The peak extra memory `flashformer bench attention` measures for one
    causal float32 point (a fresh worker process: forward, then forward + backward)."""
    from flashformer.bench.attention import MODULE
    from flashformer.bench.common import run_worker

    point = {
        "kind": "memory",
        "variant": "causal",
        "dtype": "float32",
        "n": n,
        "backend": backend,
        "device": "cpu",
    }
    result = run_worker(MODULE, point, timeout_s=600)
    assert "error" not in result, result
    return {mode: result[mode]["peak_extra_bytes"] for mode in ("forward", "train")}


def predicted_peak(backend: str, n: int) -> dict[str, int]:
    from flashformer.bench.attention import BATCH, HEAD_DIM, HEADS

    return {
        mode: costs.attention_peak_bytes(
            backend, BATCH, HEADS, n, n, HEAD_DIM, causal=True, train=mode == "train"
        )
        for mode in ("forward", "train")
    }


def test_eager_attention_peak_memory_matches_the_benchmark():
    """n where the n² buffers dominate the fresh process's one-time allocations
    (about 10 MiB for the first forward, 35 MiB for autograd's first backward)."""
    for n in (1024, 2048):
        measured, predicted = benchmark_peak("eager", n), predicted_peak("eager", n)
        for mode in ("forward", "train"):
            error = (predicted[mode] - measured[mode]) / measured[mode]
            assert abs(error) <= 0.2, (
                f"eager {mode} n={n}: measured {measured[mode]:,}, formula {predicted[mode]:,}"
            )


def assert_flash_growth(low: int, high: int) -> None:
    measured_low, measured_high = benchmark_peak("flash", low), benchmark_peak("flash", high)
    predicted_low, predicted_high = predicted_peak("flash", low), predicted_peak("flash", high)
    for mode in ("forward", "train"):
        measured = measured_high[mode] - measured_low[mode]
        predicted = predicted_high[mode] - predicted_low[mode]
        error = (predicted - measured) / measured
        assert abs(error) <= 0.2, (
            f"flash {mode} growth {low} -> {high}: measured {measured:,}, formula {predicted:,}"
        )


def test_flash_attention_peak_memory_growth_matches_the_benchmark():
    """Flash's O(n) memory (16 MiB of output at n = 8192) stays below the fresh
    process's one-time allocations at every n a CPU test can afford, so the
    comparison is of what n adds: the measured peak's growth against the formula's."""
    assert_flash_growth(1024, 2048)


@pytest.mark.slow
def test_attention_peak_memory_over_a_wider_range():
    assert_flash_growth(1024, 8192)
    measured, predicted = benchmark_peak("eager", 4096), predicted_peak("eager", 4096)
    for mode in ("forward", "train"):
        assert abs(predicted[mode] - measured[mode]) <= 0.2 * measured[mode], (mode, measured, predicted)


# ---- memory traffic ----


def test_flash_traffic_streams_the_visible_keys_once_per_query_block():
    from flashformer.costs.traffic import flash_query_block, flash_traffic

    d, e, sram = 64, 2, 48 * 1024
    block = flash_query_block(d, sram, e)
    assert block == 96 and 4 * block * d * e <= sram  # Q, O, K, V blocks fit in M
    for q_len, k_len, causal in ((1000, 1000, False), (1000, 1000, True), (300, 1300, True)):
        i = torch.arange(q_len)[:, None] + (k_len - q_len)
        visible = torch.arange(k_len)[None, :] <= i if causal else torch.ones(q_len, k_len, dtype=torch.bool)
        # a query block reads every key any of its queries can see (brute force over the mask)
        streamed = sum(
            int(visible[q0 : q0 + block].any(0).nonzero().max()) + 1 for q0 in range(0, q_len, block)
        )
        expected = (2 * q_len * d + 2 * streamed * d) * e + 4 * q_len
        assert flash_traffic(q_len, k_len, d, causal, sram, e) == expected


def test_traffic_scales_as_n2_d2_over_m():
    from flashformer.costs.traffic import eager_traffic, flash_traffic

    n, d, e = 2**17, 64, 2  # large enough that reading Q and writing O (2·n·d) are a rounding error
    for sram in (48 * 1024, 192 * 1024):
        # 2·n·m·d·e·⌈n/b⌉ with b = M / (4·d·e) tends to 8·n²·d²·e² / M
        limit = 8 * n * n * d * d * e * e / sram
        assert abs(flash_traffic(n, n, d, False, sram, e) / limit - 1) < 0.01
        assert (
            abs(eager_traffic(n, n, d, e) / flash_traffic(n, n, d, False, sram, e) - sram / (2 * d * d * e))
            < 0.2
        )
