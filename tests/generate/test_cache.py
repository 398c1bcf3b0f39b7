"""The KV cache: written in place at explicit positions, checked for length,
reordered and expanded by rows; prefill in chunks equals one prefill; a
reordered cache continues the reordered sequences exactly (what beam search
relies on). References are forward passes over whole sequences without a cache."""

from __future__ import annotations

import pytest
import torch

import flashformer
from flashformer.generate.cache import KVCache, cache_dtype, make_caches
from flashformer.generate.sampling import settings_from
from flashformer.generate.session import make_session

TOLERANCE = 1e-5  # float32


def model_of(name: str):
    """A tiny model with perturbed weights (random init leaves norms at 1 and biases at 0)."""
    torch.manual_seed(0)
    model = flashformer.build(name, vocab_size=97, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


DECODERS = ["gpt2-tiny", "llama-tiny"]  # learned positions; RoPE with GQA (4 query heads, 2 kv heads)


def left_padded_batch():
    torch.manual_seed(5)
    ids = torch.randint(3, 97, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    return ids.masked_fill(mask == 0, 0), mask


def positions_of(mask):
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def test_update_writes_in_place_and_returns_the_filled_prefix():
    cache = KVCache(2, 3, 10, 4, dtype=torch.float32, device="cpu")
    storage = cache.k.data_ptr(), cache.v.data_ptr()
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    k_all, v_all = cache.update(k1, v1, 0)
    assert k_all.shape == (2, 3, 4, 4) and torch.equal(k_all, k1) and torch.equal(v_all, v1)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    k_all, v_all = cache.update(k2, v2, 4)
    assert torch.equal(k_all, torch.cat((k1, k2), dim=2)) and torch.equal(v_all, torch.cat((v1, v2), dim=2))
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == storage  # no reallocation
    assert k_all.data_ptr() == cache.k.data_ptr()  # a view of the buffer, not a copy
    assert not cache.k[:, :, 5:].any()  # nothing written beyond


def test_a_write_past_max_len_is_refused_and_writes_nothing():
    cache = KVCache(1, 2, 6, 4, dtype=torch.float32, device="cpu")
    cache.update(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4), 0)
    with pytest.raises(
        ValueError, match=r"holds 6 tokens \(max_len\); writing 2 new tokens after cache_position=5"
    ):
        cache.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4), 5)
    assert not cache.k[:, :, 5:].any()


@pytest.mark.parametrize("name", DECODERS)
def test_decoding_never_reallocates_the_cache(name):
    model = model_of(name)
    ids, mask = left_padded_batch()
    caches = make_caches(model, 3, ids.shape[1] + 4)
    pointers = [(c.k.data_ptr(), c.v.data_ptr()) for c in caches]
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions_of(mask), kv_caches=caches)
        for step in range(4):
            length = ids.shape[1] + step
            token = torch.full((3, 1), 7)
            key_mask = torch.cat((mask, torch.ones(3, step + 1, dtype=mask.dtype)), dim=1)
            position = positions_of(key_mask)[:, -1:]
            model(
                token, attention_mask=key_mask, position_ids=position, kv_caches=caches, cache_position=length
            )
    assert [(c.k.data_ptr(), c.v.data_ptr()) for c in caches] == pointers


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("chunk", [1, 2, 4, 7])
def test_chunked_prefill_equals_one_prefill(name, chunk):
    model = model_of(name)
    ids, mask = left_padded_batch()
    positions = positions_of(mask)
    length = ids.shape[1]
    whole, chunked = make_caches(model, 3, length), make_caches(model, 3, length)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions, kv_caches=whole).logits
        pieces = []
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            out = model(
                ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=positions[:, start:end],
                kv_caches=chunked,
                cache_position=start,
            )
            pieces.append(out.logits)
    got = torch.cat(pieces, dim=1)
    real = mask.bool()
    assert (got - expected)[real].abs().max().item() <= TOLERANCE
    for a, b in zip(chunked, whole):
        assert (a.k - b.k).abs().max().item() <= TOLERANCE and (a.v - b.v).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", DECODERS + ["t5-tiny"])
def test_a_reordered_cache_continues_the_reordered_sequences(name):
    """Beam search reorders rows (some duplicated, some dropped) and continues:
    the logits must be those of the reordered sequences recomputed whole."""
    model = model_of(name)
    torch.manual_seed(1)
    batch, steps = 4, 3
    is_t5 = model.config.arch == "encoder-decoder"
    source = torch.randint(3, 97, (batch, 6))
    seqs = torch.zeros(batch, 1, dtype=torch.long) if is_t5 else torch.randint(3, 97, (batch, 5))
    caches = make_caches(model, batch, seqs.shape[1] + steps + 1)

    def forward(tokens, cache_position, kv_caches=caches):
        if is_t5:
            return model(source, decoder_input_ids=tokens, kv_caches=kv_caches, cache_position=cache_position)
        return model(tokens, kv_caches=kv_caches, cache_position=cache_position)

    with torch.no_grad():
        forward(seqs, 0)
        for _ in range(steps):
            token = torch.randint(3, 97, (batch, 1))
            forward(token, seqs.shape[1])
            seqs = torch.cat((seqs, token), dim=1)
        rows = torch.tensor([2, 2, 0, 3])  # row 1 dropped, row 2 twice
        for cache in caches:
            cache.reorder(rows, seqs.shape[1])
        seqs, source = seqs[rows], source[rows]
        token = torch.randint(3, 97, (batch, 1))
        cached = forward(token, seqs.shape[1]).logits[:, -1]
        full = forward(torch.cat((seqs, token), dim=1), 0, kv_caches=None).logits[:, -1]
    assert (cached - full).abs().max().item() <= TOLERANCE


def test_expand_repeats_each_row_in_place_of_itself():
    cache = KVCache(2, 1, 3, 2, dtype=torch.float32, device="cpu")
    cache.update(torch.arange(12.0).view(2, 1, 3, 2), torch.arange(12.0).view(2, 1, 3, 2), 0)
    cache.memory_kv = (torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]]))
    cache.expand(3)
    assert cache.k.shape == (6, 1, 3, 2)
    assert [int(cache.k[r, 0, 0, 0]) for r in range(6)] == [0, 0, 0, 6, 6, 6]
    assert cache.memory_kv[0].flatten().tolist() == [1, 1, 1, 2, 2, 2]


def test_caches_match_the_model():
    model = model_of("llama-tiny")
    caches = make_caches(model, 3, 20)
    config = model.config
    assert len(caches) == config.n_layers
    assert caches[0].k.shape == (
        3,
        config.n_kv_heads,
        20,
        config.head_dim,
    )  # GQA: kv heads, not query heads (the bytes against the formula: test_costs.py)
    t5 = model_of("t5-tiny")
    assert len(make_caches(t5, 1, 4)) == t5.config.n_decoder_layers


def test_cache_dtype_follows_autocast_then_the_parameters():
    model = model_of("gpt2-tiny")
    cpu = torch.device("cpu")
    assert cache_dtype(model, cpu) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cache_dtype(model, cpu) == torch.bfloat16
        ids = torch.randint(3, 97, (1, 4))
        out = model.generate(ids, max_new_tokens=3, eos_token_id=[])  # the trainer's bf16 sampling path
    assert out.shape == (1, 7)
    assert cache_dtype(model.to(torch.bfloat16), cpu) == torch.bfloat16


def test_a_model_may_ask_for_its_own_cache_dtype():
    """model.kv_cache_dtype (a quantized model's float16 cache) wins over autocast and the parameters."""
    model = model_of("gpt2-tiny")
    model.kv_cache_dtype = torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cache_dtype(model, torch.device("cpu")) == torch.float16
    assert make_caches(model, 2, 8)[0].v.dtype == torch.float16
    ids = torch.randint(3, 97, (2, 5))
    out = model.generate(ids, max_new_tokens=4, eos_token_id=[], do_sample=False)
    model.kv_cache_dtype = None
    assert out.shape == (2, 9) and cache_dtype(model, torch.device("cpu")) == torch.float32


# ---- the cache's element types (kernels/kv_blocks.py) ----


def model_with_heads_of(dim: int):
    """A tiny LLaMA (GQA) whose heads hold `dim` values: 32, one q8_0 / q4_0 block a head; 64,
    keys and values rotated before they are quantized (kernels/kv_blocks.py)."""
    torch.manual_seed(0)
    model = flashformer.build("llama-tiny", d_model=4 * dim, n_heads=4, n_kv_heads=2, vocab_size=97)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize("dim", [32, 64])
@pytest.mark.parametrize("pair", [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("f16", "q4_0")], ids="/".join)
def test_block_caches_decode_natively_as_the_eager_modules_do(pair, dim):
    """The native decoder writes and reads the blocks in place (rotating q, k, v and the output
    itself); the eager modules quantize in update() and attend over the values rotated back: the
    same greedy tokens. The blocks cost their bytes."""
    model = model_with_heads_of(dim)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=16, do_sample=False, cache_type_k=pair[0], cache_type_v=pair[1])
    native = model.generate(ids, **options)
    assert torch.equal(native, model.generate(ids, native=False, **options))
    first = {}
    for types in [pair, ("f32", "f32")]:
        settings = settings_from(model, max_new_tokens=4, cache_type_k=types[0], cache_type_v=types[1])
        first[types] = make_session(model, ids, None, settings).prefill()
    assert not torch.equal(first[pair], first[("f32", "f32")])  # the blocks' values, not the floats
    caches = make_caches(model, 1, 64, cache_type_k=pair[0], cache_type_v=pair[1])
    floats = make_caches(model, 1, 64, cache_type_k="f16", cache_type_v="f16")
    expected = {"f16": 1.0, "q8_0": 34 / 64, "q4_0": 18 / 64}
    assert caches[0].k.nbytes == expected[pair[0]] * floats[0].k.nbytes
    assert caches[0].v.nbytes == expected[pair[1]] * floats[0].v.nbytes


def test_a_float16_cache_serves_a_float32_model_on_every_path():
    model = model_of("llama-tiny")
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=8, do_sample=False, cache_type_k="f16", cache_type_v="f16")
    assert make_caches(model, 1, 8, cache_type_k="f16")[0].k.dtype == torch.float16
    assert make_caches(model, 1, 8, cache_type_k="f16")[0].v.dtype == torch.float32  # the model's own
    assert torch.equal(model.generate(ids, **options), model.generate(ids, native=False, **options))


def test_cache_types_are_checked_by_name():
    model = model_of("llama-tiny")
    with pytest.raises(ValueError, match=r"cache_type_v: expected one of f32, f16, q8_0, q4_0 .* got 'q8'"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=2, cache_type_v="q8")
