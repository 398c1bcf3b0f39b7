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
from flashformer.kernels.quantized import QuantizedEmbedding, QuantizedLinear
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
