"""A PEFT adapter on a GGUF file's quantized blocks (the low-rank product beside them, the blocks
untouched), through load(), `generate --lora`, `chat --lora` and `export --merge-lora`. The
reference: peft's PeftModel on the file's own weights (its blocks dequantized, as transformers
reads them), which the quantized layers multiply exactly with float32 activations."""

from __future__ import annotations

import pytest
import torch

import flashformer
from flashformer.adapters import LoRALinear, lora_layers
from flashformer.cli import chat as chat_command
from flashformer.cli import commands as cli
from flashformer.cli import eval as eval_command
from flashformer.kernels.quantized import ConcatenatedLinear, QuantizedLinear
from flashformer.model.native import native_unsupported
from tests.helpers import relative_error
from tests.helpers.gguf import cycle_types, llama_metadata, llama_tensors, tiny_llama, write_gguf

pytest.importorskip("peft")

PROMPT = "the and 12"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(GGUF file of Q8_0 / Q4_0 / Q5_1 blocks, its float weights as a transformers folder, a
    random PEFT adapter on q, k, v, o, gate, up and down)."""
    from peft import LoraConfig, get_peft_model

    folder = tmp_path_factory.mktemp("quantized-lora")
    model = tiny_llama()
    path = write_gguf(
        folder / "tiny.gguf",
        "llama",
        llama_metadata(model),
        llama_tensors(model, cycle_types("Q8_0", "Q4_0", "Q5_1")),
    )
    float_model, tokenizer = flashformer.load(path, quantize=None)
    float_model.save_pretrained(folder / "float")
    tokenizer.save(folder / "float")
    torch.manual_seed(2)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = get_peft_model(tiny_llama(seed=1), LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    adapted.save_pretrained(folder / "adapter")
    return path, folder / "float", folder / "adapter"


def peft_logits(base_folder, adapter, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder).eval()
    with torch.no_grad():
        return PeftModel.from_pretrained(base, adapter).eval()(ids).logits


IDS = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(4))


def test_adapter_beside_quantized_blocks_equals_peft_on_their_weights(files):
    path, float_folder, adapter = files
    model, _ = flashformer.load(path, activations="float32", adapters=adapter)
    layers = lora_layers(model)
    assert len(layers) == 2 * 5  # per layer: qkv, out, gate, up, down
    assert all(isinstance(layer.base, QuantizedLinear | ConcatenatedLinear) for layer in layers.values())
    expected = peft_logits(float_folder, adapter, IDS)
    with torch.no_grad():
        got = model(IDS).logits
        plain = flashformer.load(path, activations="float32")[0](IDS).logits
    assert relative_error(plain, expected) > 1e-2, "the adapter must change the logits"
    assert relative_error(got, expected) < 1e-4


def test_int8_activations_and_the_native_decoder_declines(files):
    path, float_folder, adapter = files
    model, _ = flashformer.load(path, adapters=adapter)  # the default: int8 activations
    reason = native_unsupported(model)
    assert reason is None or "LoRALinear" in reason or "C++" in reason
    assert model.native_decoder() is None
    expected = peft_logits(float_folder, adapter, IDS)
    with torch.no_grad():
        got = model(IDS).logits
    # int8 inputs round each block of 32 (llama.cpp's scheme): about 1e-2 of the largest logit
    assert relative_error(got, expected) < 5e-2


def _next_or_eof(lines):
    line = next(lines, None)
    if line is None:
        raise EOFError
    return line


def run_cli(args, capsys, stdin=None):
    code = cli.main(args)
    return code, capsys.readouterr().out


def test_generate_and_chat_with_lora_print_the_adapted_model_greedy_text(files, capsys):
    path, _, adapter = files
    code, out = run_cli(
        [
            "generate",
            str(path),
            "--lora",
            str(adapter),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--greedy",
        ],
        capsys,
    )
    assert code in (0, None)
    model, tokenizer = flashformer.load(path, adapters=adapter)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    new = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert out.startswith(PROMPT + tokenizer.decode(new))
    template = adapter.parent / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    lines = iter(["hello"])
    chat = ["chat", str(path), "--lora", f"mine={adapter}", "--chat-template", str(template)]
    args = cli.build_parser().parse_args([*chat, "--max-new-tokens", "6", "--greedy"])
    chat_command.main_from_args(args, input_line=lambda prompt: _next_or_eof(lines))
    ids = torch.tensor([tokenizer.encode("hello ")])
    new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    assert capsys.readouterr().out.splitlines()[0] == tokenizer.decode(new)
    bad = adapter.parent / "bad"
    bad.mkdir(exist_ok=True)
    config = (adapter / "adapter_config.json").read_text()
    (bad / "adapter_config.json").write_text(config.replace('"r": 8', '"r": 4'))
    (bad / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    with pytest.raises(SystemExit):
        cli.main(["generate", str(path), "--lora", str(bad), "--prompt", PROMPT])
    error = capsys.readouterr().err
    assert "bad/adapter_model.safetensors: module 'model.layers.0.mlp.down_proj'" in error
    assert "shape (8, 128); expected (4, 128)" in error


def test_export_merge_lora_writes_a_float_model_that_equals_peft(files, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    path, float_folder, adapter = files
    cli.main(
        ["export", str(float_folder), "--lora", str(adapter), "--merge-lora", "--hf", str(tmp_path / "m")]
    )
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()(IDS).logits
    assert relative_error(merged, peft_logits(float_folder, adapter, IDS)) < 1e-4
    with pytest.raises(SystemExit):
        cli.main(["export", str(float_folder), "--lora", str(adapter), "--hf", str(tmp_path / "n")])
    assert "--merge-lora and --lora go together" in capsys.readouterr().err
    # --gguf: the merged weights written as the merged folder's are (the writer is tested elsewhere)
    merge = ["--lora", str(adapter), "--merge-lora", "--no-progress"]
    cli.main(["export", str(float_folder), *merge, "--gguf", str(tmp_path / "merged.gguf")])
    cli.main(["export", str(tmp_path / "m"), "--gguf", str(tmp_path / "from-folder.gguf"), "--no-progress"])
    with torch.no_grad():
        a = flashformer.from_pretrained(tmp_path / "merged.gguf", quantize=None)(IDS).logits
        b = flashformer.from_pretrained(tmp_path / "from-folder.gguf", quantize=None)(IDS).logits
    assert torch.equal(a, b)


def test_a_lora_layer_keeps_the_quantized_blocks_it_wraps(files):
    path, _, adapter = files
    plain, _ = flashformer.load(path)
    model, _ = flashformer.load(path, adapters=adapter)
    layer = model.decoder.blocks[0].attn.qkv
    assert isinstance(layer, LoRALinear)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(layer.base(x), plain.decoder.blocks[0].attn.qkv(x))


def test_eval_perplexity_with_lora_scores_the_adapted_model(files, tmp_path, capsys):
    from flashformer.eval.perplexity import perplexity

    path, _, adapter = files
    text = tmp_path / "a.txt"
    text.write_text("the and 12 there in the answer and the 12 " * 4)
    command = ["eval", "perplexity", str(path), "--lora", str(adapter), "--data", str(text), "--no-progress"]
    payload = eval_command.main_from_args(cli.build_parser(command).parse_args(command))
    model, tokenizer = flashformer.load(path, adapters=adapter)
    expected = perplexity(model, tokenizer, [text.read_text()])
    plain = perplexity(*flashformer.load(path), [text.read_text()])
    assert payload["mean_nll"] == pytest.approx(expected.mean_nll, rel=1e-6)
    assert abs(plain.mean_nll - expected.mean_nll) > 1e-3
    assert payload["adapters"] == {adapter.name: str(adapter)}


@pytest.mark.slow
def test_smollm2_q4_1_with_an_adapter_equals_peft_on_transformers_gguf_load(tmp_path):
    """The real model: SmolLM2's Q4_1 file with a random adapter on every projection, against peft
    on transformers' reading of the same file (its blocks dequantized)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flashformer.checkpoints.gguf.packaged_models import smollm2_path

    path = smollm2_path()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    adapted = get_peft_model(theirs, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    adapted.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(100, 49000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = adapted.eval()(ids).logits
        with adapted.disable_adapter():
            plain = adapted(ids).logits
        model, _ = flashformer.load(path, activations="float32", adapters=tmp_path / "adapter")
        got = model(ids).logits
    assert relative_error(plain, expected) > 1e-2, "the adapter must change the logits"
    assert relative_error(got, expected) < 1e-4
