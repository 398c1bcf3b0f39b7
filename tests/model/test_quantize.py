"""Quantized models (flashformer.model.quantize): a float model's projections, embedding and head
as int8 / int4 layers, and a GGUF file's own Q4/Q8 blocks. The reference for a quantized
model is the float model holding the dequantized weights: with float32 activations the two
compute the same products, so their logits agree to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from helpers import perturbed
from helpers.gguf import smollm2_model

import flashformer
from flashformer import cli
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.eval.kld import cached_chunk_logits
from flashformer.kernels.quantized import QuantizedEmbedding, QuantizedLinear
from flashformer.model.native import native_unsupported
from flashformer.model.quantize import quantize

VOCAB = 160


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def folder(request, tmp_path_factory):
    """A Hugging Face folder of a small random model (widths multiples of 32, as 4-bit blocks
    need), every parameter perturbed; GPT-2 with its tied head, LLaMA with its own."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if request.param == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    path = tmp_path_factory.mktemp(request.param)
    perturbed(model, scale=0.3).save_pretrained(path)
    return path


def dequantized_twin(folder, quantized):
    """The float model with the quantized model's weights, dequantized, in every quantized layer."""
    twin = flashformer.from_pretrained(folder)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and name != "lm_head":
                twin.get_submodule(name).weight.copy_(module.dequantize())
        if twin.lm_head is not None:
            twin.lm_head.weight.copy_(quantized.lm_head.dequantize())
    return twin


IDS = torch.randint(0, VOCAB, (3, 21), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_logits_equal_the_dequantized_float_model(folder, mode):
    model = flashformer.from_pretrained(folder, quantize=mode, activations="float32")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) >= 2 * 3 + 1  # every block's projections and the head
    assert isinstance(model.embeddings.tokens, QuantizedEmbedding) and model.quantization == mode
    with torch.no_grad():
        got = model(IDS).logits
        want = dequantized_twin(folder, model)(IDS).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-5


def test_int8_activations_add_less_error_than_4_bit_weights(folder):
    """Quantizing the activations per block of 32 (llama.cpp's way) moves the logits less than
    rounding the weights to 4 bits does: judged against the error the format already has."""
    with torch.no_grad():
        exact = flashformer.from_pretrained(folder, quantize="int4", activations="float32")(IDS).logits
        fast = flashformer.from_pretrained(folder, quantize="int4", activations="int8")(IDS).logits
        float_logits = flashformer.from_pretrained(folder)(IDS).logits
    assert 0 < (fast - exact).abs().mean() < (exact - float_logits).abs().mean()


def rounded_to_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) float64 -> the values of its int8 blocks of 32, the kernels' rule written out:
    d = amax / 127, q = round(x * 127 / amax), half to even."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127)).reshape(x.shape)


def rule_logits(folder, quantized, head_rounded: bool) -> torch.Tensor:
    """IDS's logits in float64 math: the dequantized weights, every block projection's input
    rounded to int8 blocks, the head's too where head_rounded."""
    twin = dequantized_twin(folder, quantized).double()
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedLinear) and name != "lm_head":
            twin.get_submodule(name).register_forward_pre_hook(
                lambda _, args: (rounded_to_int8_blocks(args[0]),)
            )
    if head_rounded:  # the decoder's output is the head's input (tied or not)
        twin.decoder.register_forward_hook(lambda _, args, out: rounded_to_int8_blocks(out))
    with torch.no_grad():
        return twin(IDS).logits


HEAD_SCHEMES = {"int8-float32-head": "float32", "int8-int8x2-head": "int8x2"}


@pytest.mark.parametrize("scheme", HEAD_SCHEMES)
def test_a_head_scheme_rounds_every_input_but_the_heads(folder, scheme):
    """activations="int8-float32-head" / "int8-int8x2-head": the blocks' projections read int8
    blocks of their input, the head its float32 input (int8x2: its int8 blocks plus theirs of the
    rounding error, ~15 bits). Against float64 math of that rule with the head's input exact, the
    logits agree to float32 rounding (a rounding moved by an ulp upstream allowed for), 20x closer
    than to the same math with the head's input rounded too, which is what "int8" computes."""
    model = flashformer.from_pretrained(folder, quantize="int4", activations=scheme)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert layers.pop("lm_head").activations == HEAD_SCHEMES[scheme]
    assert layers and all(m.activations == "int8" for m in layers.values())
    assert model.kv_cache_dtype == torch.float16
    with torch.no_grad():
        got = model(IDS).logits.double()
        int8_got = flashformer.from_pretrained(folder, quantize="int4", activations="int8")(
            IDS
        ).logits.double()
    want, head_rounded = rule_logits(folder, model, False), rule_logits(folder, model, True)
    error, gap = (got - want).abs().max(), (head_rounded - want).abs().max()
    assert error <= 1e-3 * want.abs().max() and 20 * error < gap
    assert (int8_got - head_rounded).abs().max() < gap / 4  # the int8 scheme is the other rule


@pytest.mark.parametrize("scheme", HEAD_SCHEMES)
def test_the_native_decoder_runs_the_head_as_the_scheme_says(folder, scheme):
    """The native decoder (what generate runs) reads each layer's own choice: over a float32
    cache its logits are the modules' (whose head's input is float or int8x2, above) to float32
    rounding; had it rounded the head's input to int8, they would differ by the head's int8 error."""
    model = flashformer.from_pretrained(folder, quantize="int4", activations=scheme)
    assert native_unsupported(model) is None
    with torch.no_grad():
        eager = model(IDS[:1]).logits[0, -12:]
        native = cached_chunk_logits("f32", "f32")(model, IDS[0], 12)  # a prompt, then 12 over the cache
        int8_head = rule_logits(folder, model, True)[0, -12:]
    assert (native - eager).abs().max() <= 2e-5 * eager.abs().max()
    assert (int8_head - eager.double()).abs().max() > 100 * (native - eager).abs().max()


def test_greedy_tokens_are_the_same_every_run_and_every_batch_size(folder):
    model = flashformer.from_pretrained(folder, quantize="int4")
    prompt = IDS[:1, :9]
    alone = model.generate(prompt, max_new_tokens=12, do_sample=False)
    again = model.generate(prompt, max_new_tokens=12, do_sample=False)
    batched = model.generate(torch.cat([prompt, IDS[1:3, :9]]), max_new_tokens=12, do_sample=False)
    assert torch.equal(alone, again) and torch.equal(alone[0], batched[0])


def test_int8_activations_keep_a_float16_kv_cache_which_adds_less_error_than_the_weights(folder):
    """With int8 activations the KV cache is float16, llama.cpp's default (half the bytes a decode
    step reads); float32 activations keep float32. Rounding the cached keys and values moves the
    logits less than rounding the weights to 4 bits does."""
    from flashformer.generate.cache import make_caches

    assert flashformer.from_pretrained(folder, quantize="int4", activations="float32").kv_cache_dtype is None
    model = flashformer.from_pretrained(folder, quantize="int4")
    assert model.kv_cache_dtype == torch.float16
    half_caches = make_caches(model, 3, 32)
    assert half_caches[0].k.dtype == half_caches[0].v.dtype == torch.float16
    with torch.no_grad():
        over_half = model(IDS, kv_caches=half_caches, cache_position=0).logits
        model.kv_cache_dtype = None
        over_float = model(IDS, kv_caches=make_caches(model, 3, 32), cache_position=0).logits
        float_logits = flashformer.from_pretrained(folder)(IDS).logits
    assert 0 < (over_half - over_float).abs().mean() < (over_float - float_logits).abs().mean()


def test_a_quantized_model_refuses_training_and_saving(folder, tmp_path):
    model = flashformer.from_pretrained(folder, quantize="int8")
    with pytest.raises(RuntimeError, match="quantized \\(int8\\) and cannot be trained"):
        model.train()
    with pytest.raises(ValueError, match="save the float model"):
        model.save_pretrained(tmp_path / "out")
    model.eval()  # eval mode stays allowed


def test_bad_arguments_are_refused_by_name(folder):
    with pytest.raises(ValueError, match="quantize must be one of"):
        flashformer.from_pretrained(folder, quantize="int3")
    with pytest.raises(ValueError, match="activations must be one of .*'int8-float32-head'.*; got 'int4'"):
        flashformer.from_pretrained(folder, quantize="int8", activations="int4")
    with pytest.raises(ValueError, match="give a .gguf file"):
        flashformer.from_pretrained(folder, quantize="gguf")
    with pytest.raises(ValueError, match="serve decoders"):
        quantize(flashformer.build("bert-tiny"), "int8")


def test_gguf_mode_multiplies_the_files_own_blocks():
    """SmolLM2's Q4_1 projections and Q8_0 embedding, repacked: dequantized they are the float
    model's weights (gguf's dequantizer) bit for bit, and the tied head reads the embedding."""
    float_model = smollm2_model()
    model = flashformer.from_pretrained(smollm2_path(), quantize="gguf", activations="float32")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 30 * 5 + 1  # qkv (stacked), out, gate, up, down per layer; the head
    for name, module in layers.items():
        want = (
            float_model.embeddings.tokens.weight
            if name == "lm_head"
            else float_model.get_submodule(name).weight
        )
        assert torch.equal(module.dequantize(), want), name
    assert torch.equal(model.embeddings.tokens.dequantize(), float_model.embeddings.tokens.weight)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 9840, 30]])
    with torch.no_grad():
        got, want = model(ids).logits, float_model(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("scheme", HEAD_SCHEMES)
def test_a_gguf_files_tied_head_reads_its_inputs_as_the_scheme_says(scheme):
    """SmolLM2's head is its Q8_0 embedding's bytes (from_embedding): the scheme reaches it there
    too, and every block projection keeps int8 inputs."""
    model = flashformer.from_pretrained(smollm2_path(), quantize="gguf", activations=scheme)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    head = layers.pop("lm_head")
    assert head.qweight is model.embeddings.tokens.qweight and head.activations == HEAD_SCHEMES[scheme]
    assert len(layers) == 30 * 5 and all(m.activations == "int8" for m in layers.values())


PROMPT = "def "


def run_cli(args, capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(args)
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cli_generate_with_quantize(tiny_run, mode, capsys):
    """--quantize reaches the loader: the CLI's greedy continuation is the quantized API model's."""
    args = ["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", "12", "--greedy"]
    code, out, _ = run_cli([*args, "--quantize", mode], capsys)
    assert code == 0
    model, tokenizer = flashformer.load(tiny_run, quantize=mode)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    eos = tokenizer.token_id("<|endoftext|>")
    expected = model.generate(ids, max_new_tokens=12, eos_token_id=eos)[0, ids.shape[1] :].tolist()
    assert out == PROMPT + tokenizer.decode(expected) + "\n"
    code, _, err = run_cli([*args, "--quantize", "int5"], capsys)
    assert code == 2 and "invalid choice: 'int5'" in err
