"""checkpoints.gguf.writer and loading.export_gguf: models written as GGUF files.

References, none of them our writer's own output: transformers' GGUF loader reading the file
we wrote (its own metadata parsing and q/k reordering), the transformers model the file came
from with its weights rounded through the format by independent code (torch's float16, the
`gguf` library's Q8_0), transformers' GGUF tokenizer, and, where llama-cpp-python is installed,
llama.cpp itself (loading the file; quantizing the f16 file to Q4_K_M with its own quantizer)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from helpers import perturbed, train_tiny_run
from tokenizers import Regex, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import flashformer
from flashformer.checkpoints.gguf import read_file, read_gguf
from flashformer.checkpoints.gguf.architectures import ARCHITECTURES
from flashformer.checkpoints.gguf.tokenizer import LLAMA3_SPLIT, read_tokenizer
from flashformer.checkpoints.gguf.writer import tensor_type, use_more_bits, write_gguf
from flashformer.checkpoints.loading import export_gguf
from flashformer.cli import commands
from flashformer.text.bpe import train_bpe

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
NO_LLAMA_CPP = "llama-cpp-python is not installed in this environment"
VOCAB = 512  # the models' rows; the tokenizer has fewer tokens, so the file pads with [PAD] tokens

TEXTS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n",
    "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it?",
    "for i in range(10):\n\tprint(i ** 2, 'squared')  # 0 1 4 9\n",
] * 20

BATTERY = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "spaces:  two   three    four     five\n\n\n\nend \t \n",
    "3.14159265358979 and 1234567890, 007, $12.50",
    "café naïve Ångström 日本語 中文 🎉👍🏽",
    "I'm sure they'll say it's fine<|endoftext|>don't you think?<pad>",
    "",
    " ",
]


@pytest.fixture(scope="module")
def tokenizer():
    trained = train_bpe(TEXTS, vocab_size=420, show_progress=False)
    trained.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    return trained


def llama(d_model: int = 256, tied: bool = False, layers: int = 2, **changes):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        **changes,
    )
    return perturbed(LlamaForCausalLM(config), scale=0.05)


def qwen2(d_model: int = 256):
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return perturbed(Qwen2ForCausalLM(config), scale=0.05)


# Llama 3.1's RoPE scaling, with its wavelength band inside the head's frequencies
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}  # fmt: skip


def gpt2(d_model: int = 256):
    # 1024 positions: transformers' GGUF loader does not read gpt2.context_length into n_positions
    config = GPT2Config(vocab_size=VOCAB, n_embd=d_model, n_layer=2, n_head=4, n_positions=1024)
    return perturbed(GPT2LMHeadModel(config), scale=0.05)


MODELS = {
    "llama": llama,
    "llama-tied": lambda: llama(tied=True),
    "llama3-rope": lambda: llama(rope_parameters=LLAMA3_ROPE),
    "gpt2": gpt2,
    "qwen2": qwen2,
    "llama-64": lambda: llama(64),
}
ARCHITECTURE = {"gpt2": "gpt2", "qwen2": "qwen2"}  # the others: llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    made = {}

    def make(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            model = MODELS[name]()
            model.save_pretrained(path)
            tokenizer.save(path)
            made[name] = (path, model)
        return made[name]

    return make


def input_ids(batch: int = 2, length: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def through_the_format(model, types: dict[str, str], architecture: str):
    """The transformers model with every weight rounded as the file stores it, by code other
    than ours: torch's float16, the `gguf` library's Q8_0 quantizer and dequantizer."""
    state, rounded_state = model.state_dict(), {}
    specs = ARCHITECTURES[architecture].tensors(_hf_config(model))
    for spec in specs:
        if spec.hf is None:  # rope_freqs.weight: the config's RoPE scaling, not a weight
            continue
        values = state[spec.hf].float()
        values = values.t() if spec.conv1d else values  # rows along the file's blocks
        kind = types[spec.gguf]
        if kind == "F16":
            values = values.half().float()
        elif kind == "Q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            values = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values.numpy(), q8), q8))
        else:
            assert kind == "F32", kind
        rounded_state[spec.hf] = values.t() if spec.conv1d else values
    rounded = type(model)(model.config)
    missing, unexpected = rounded.load_state_dict(rounded_state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # a tied head is the embedding
    return rounded.eval()


def _hf_config(model) -> dict:
    values = model.config.to_dict()
    values.setdefault("n_inner", None)
    if values.get("n_inner") is None and values["model_type"] == "gpt2":
        values["n_inner"] = 4 * values["n_embd"]
    values.setdefault(
        "head_dim", values.get("hidden_size", 0) // max(values.get("num_attention_heads", 1), 1)
    )
    values.setdefault("attention_bias", False)
    values.setdefault("mlp_bias", False)
    return values


# ---- f16 and q8_0: the model the file holds is the original, rounded as the format rounds ----


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2", "qwen2"])
@pytest.mark.parametrize("file_type", ["f16", "q8_0"])
def test_logits_equal_the_model_rounded_through_the_format(folder, tmp_path, name, file_type):
    path, model = folder(name)
    out = tmp_path / f"{name}.gguf"
    types = export_gguf(path, out, file_type, show_progress=False)
    expected_types = {"F32", "F16"} if file_type == "f16" else {"F32", "Q8_0"}
    assert set(types.values()) == expected_types
    with torch.no_grad():
        expected = through_the_format(model, types, ARCHITECTURE.get(name, "llama"))(input_ids()).logits
        ours = flashformer.from_pretrained(out, quantize=None)(input_ids()).logits
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name).eval()(input_ids()).logits
    assert (ours - expected).abs().max() < 1e-4
    assert (theirs - expected).abs().max() < 1e-4  # transformers reads the file as we do
    with torch.no_grad():
        original = model(input_ids()).logits
    assert (
        0 < (expected - original).abs().max() < 0.1 * original.abs().max()
    )  # the rounding is real and small


def test_llama3_rope_scaling_is_written_as_rope_freqs(folder, tmp_path):
    path, model = folder("llama3-rope")
    out = tmp_path / "l3.gguf"
    types = export_gguf(path, out, "f16", show_progress=False)
    assert types["rope_freqs.weight"] == "F32"
    assert read_gguf(out, show_progress=False).config["rope_parameters"]["rope_type"] == "llama3"
    with torch.no_grad():
        expected = through_the_format(model, types, "llama")(input_ids(1, 40)).logits  # past 32 positions
        ours = flashformer.from_pretrained(out, quantize=None)(input_ids(1, 40)).logits
    assert (ours - expected).abs().max() < 1e-4


# ---- q4_k_m: llama-quantize's mix, our K-quant blocks ----


def test_q4_k_m_types_follow_llama_quantize(folder, tmp_path):
    path, model = folder("llama")
    types = export_gguf(path, tmp_path / "q.gguf", "q4_k_m", show_progress=False)
    # 2 layers: use_more_bits is true for layer 1 only (n/8 = 0, 7n/8 = 1)
    expected = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K", "output_norm.weight": "F32"}
    for i, more in ((0, "Q4_K"), (1, "Q6_K")):
        expected.update({f"blk.{i}.attn_v.weight": more, f"blk.{i}.ffn_down.weight": more})
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            expected[f"blk.{i}.{part}.weight"] = "Q4_K"
        for norm in ("attn_norm", "ffn_norm"):
            expected[f"blk.{i}.{norm}.weight"] = "F32"
    assert types == expected
    stored = {name: raw.ggml_type for name, raw in read_file(tmp_path / "q.gguf").tensors.items()}
    assert stored == expected


def test_use_more_bits_is_llama_cpps_rule():
    # 16 layers (Llama-3.2-1B): the first 2, the last 2, and every third between from layer 4
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(32) if use_more_bits(i, 32)] == [
        0,
        1,
        2,
        3,
        6,
        9,
        12,
        15,
        18,
        21,
        24,
        27,
        28,
        29,
        30,
        31,
    ]


def test_q4_k_m_tied_embedding_and_fused_qkv_types(folder, tmp_path):
    specs = ARCHITECTURES["llama"].tensors(_hf_config(folder("llama-tied")[1]))
    assert (
        tensor_type(next(s for s in specs if s.gguf == "token_embd.weight"), "q4_k_m", 2, tied=True) == "Q6_K"
    )
    gpt2_types = export_gguf(folder("gpt2")[0], tmp_path / "g.gguf", "q4_k_m", show_progress=False)
    assert gpt2_types["blk.0.attn_qkv.weight"] == "Q5_K"  # llama-quantize's Q4_K_M rule for attn_qkv
    assert gpt2_types["position_embd.weight"] == "F32" and gpt2_types["token_embd.weight"] == "Q6_K"


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "llama-64"])
def test_q4_k_m_file_reads_as_transformers_reads_it(folder, tmp_path, name):
    path, model = folder(name)
    out = tmp_path / f"{name}.gguf"
    types = export_gguf(path, out, "q4_k_m", show_progress=False)
    if name == "llama-64":  # rows of 64: llama.cpp's fallbacks (Q4_K -> Q5_0, the head Q8_0)
        assert set(types.values()) == {"F32", "Q5_0", "Q8_0"} and types["output.weight"] == "Q8_0"
    with torch.no_grad():
        ours = flashformer.from_pretrained(out, quantize=None)(input_ids()).logits
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name).eval()(input_ids()).logits
        original = model(input_ids()).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - original).abs().max() > 0  # quantized (how well: the next test, per tensor)


def test_q4_k_m_weights_are_close_to_the_floats(folder, tmp_path):
    path, model = folder("llama")
    export_gguf(path, tmp_path / "q.gguf", "q4_k_m", show_progress=False)
    checkpoint = read_gguf(tmp_path / "q.gguf", show_progress=False)  # gguf's dequantizer
    state = model.state_dict()
    bound = {"Q4_K": 0.12, "Q6_K": 0.03}  # relative RMS; gaussian weights give about 0.07 and 0.018
    for name, record in checkpoint.quantized.items():
        exact = state[name]
        error = (checkpoint.tensors[name] - exact).square().mean().sqrt() / exact.square().mean().sqrt()
        assert error < bound[record.ggml_type], (name, record.ggml_type, float(error))


# ---- the tokenizer ----


def test_tokenizer_round_trip(folder, tmp_path, tokenizer):
    out = tmp_path / "t.gguf"
    export_gguf(folder("llama-64")[0], out, "f16", show_progress=False)
    ours = read_tokenizer(out)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    metadata = read_file(out).metadata
    assert metadata["tokenizer.ggml.pre"] == "gpt-2" and len(metadata["tokenizer.ggml.tokens"]) == VOCAB
    assert metadata["tokenizer.ggml.tokens"][VOCAB - 1] == f"[PAD{VOCAB - 1}]"
    for text in BATTERY:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
        assert theirs.encode(text, add_special_tokens=False) == tokenizer.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert ours.eos_token_id == tokenizer.token_id("<|endoftext|>")  # the runs' document separator
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )


def test_llama3_split_is_named_llama_bpe(tmp_path, tokenizer):
    from flashformer.checkpoints.gguf.tokenizer_writer import tokenizer_metadata

    llama3 = train_bpe(TEXTS, vocab_size=420, show_progress=False)
    llama3.backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    assert tokenizer_metadata(llama3, VOCAB, "x")["tokenizer.ggml.pre"] == "llama-bpe"
    assert tokenizer_metadata(tokenizer, VOCAB, "x")["tokenizer.ggml.pre"] == "gpt-2"


# ---- a run of `flashformer train` ----


def test_a_training_run_exports(tmp_path):
    from flashformer.model.presets import preset
    from flashformer.train.config import TrainConfig
    from flashformer.train.trainer import Trainer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(TEXTS[:6]):
        (corpus / f"f{i}.py").write_text(text * 3)
    config = preset("gpt2-tiny", n_layers=1, d_model=32, n_heads=2, d_ff=64, max_seq_len=32, vocab_size=400)
    train = TrainConfig(
        data=[str(corpus)], tokenizer="bpe", vocab_size=400, seq_len=16, batch_size=2, max_steps=2,
        warmup_steps=1, eval_every=2, eval_batches=1, save_every=2, log_every=2, sample_tokens=2,
        val_fraction=0.2,
    )  # fmt: skip
    Trainer(config, train, tmp_path / "run", show_progress=False).fit()
    out = tmp_path / "run.gguf"
    export_gguf(tmp_path / "run", out, "f16", show_progress=False)
    model, tokenizer = flashformer.load(tmp_path / "run")
    exported, exported_tokenizer = flashformer.load(out, quantize=None)
    rounded = model
    with torch.no_grad():  # as the f16 file stores them: the matrices float16, the position table float32
        for name, parameter in rounded.named_parameters():
            if parameter.dim() == 2 and name != "embeddings.positions.weight":
                parameter.copy_(parameter.half().float())
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b\n")])
    assert exported_tokenizer.encode("def add(a, b):\n    return a + b\n") == ids[0].tolist()
    with torch.no_grad():
        assert (exported(ids).logits - rounded(ids).logits).abs().max() < 1e-4


def test_a_byte_tokenizer_run_is_refused(tmp_path):
    (tmp_path / "corpus").mkdir()
    train_tiny_run(tmp_path / "corpus", tmp_path / "run")
    with pytest.raises(ValueError, match=r"byte tokenizer.*--train\.tokenizer bpe"):
        export_gguf(tmp_path / "run", tmp_path / "x.gguf", "f16", show_progress=False)
    assert not (tmp_path / "x.gguf").exists()


# ---- refusals and the atomic file ----


def test_bad_requests_are_refused_by_name(folder, tmp_path):
    path, _ = folder("llama-64")
    with pytest.raises(ValueError, match="--type must be one of f16, q8_0, q4_k_m; got 'q4_0'"):
        export_gguf(path, tmp_path / "a.gguf", "q4_0")
    (tmp_path / "a.gguf").write_bytes(b"old")
    with pytest.raises(FileExistsError, match=r"a\.gguf exists; pass --force"):
        export_gguf(path, tmp_path / "a.gguf", "f16")
    assert (tmp_path / "a.gguf").read_bytes() == b"old"
    export_gguf(path, tmp_path / "a.gguf", "f16", force=True, show_progress=False)
    with pytest.raises(ValueError, match="is a GGUF file already"):
        export_gguf(tmp_path / "a.gguf", tmp_path / "b.gguf", "f16")


def test_a_family_without_a_gguf_writer_is_refused(tmp_path, tokenizer):
    from flashformer.model.models import build
    from flashformer.model.presets import preset

    model = build(preset("bert-tiny", vocab_size=VOCAB))
    model.save_pretrained(tmp_path / "bert")
    tokenizer.save(tmp_path / "bert")
    with pytest.raises(
        ValueError,
        match=r"a 'bert' model cannot be written to GGUF \(supported: gpt2, llama, qwen2, smollm3\)",
    ):
        export_gguf(tmp_path / "bert", tmp_path / "b.gguf", "f16", show_progress=False)


def test_an_interrupted_write_leaves_no_file(folder, tmp_path, tokenizer):
    path, model = folder("llama-64")
    hf_config = _hf_config(model)
    state = model.state_dict()
    calls = []

    def tensor(name):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the tensors
        return state[name]

    with pytest.raises(KeyboardInterrupt):
        write_gguf(tmp_path / "m.gguf", hf_config, tensor, tokenizer, "q8_0", show_progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_cli_export(folder, tmp_path, capsys):
    path, _ = folder("llama-64")
    out = tmp_path / "m.gguf"
    assert commands.main(["export", str(path), "--gguf", str(out), "--type", "q8_0", "--no-progress"]) == 0
    assert "Q8_0" in capsys.readouterr().out and out.is_file()
    with pytest.raises(SystemExit) as exit_info:
        commands.main(["export", str(path), "--gguf", str(out)])
    assert exit_info.value.code == 2 and "exists; pass --force" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        commands.main(["export", str(path), "--gguf", str(out), "--type", "q4_0"])
    assert "argument --type: invalid choice: 'q4_0'" in capsys.readouterr().err


# ---- llama.cpp itself ----

QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def llama_quantize(source, target) -> None:
    """llama.cpp's own Q4_K_M quantization of an f16 file (llama-quantize), in a process of its
    own: in one that has run a llama_cpp.Llama it crashes."""
    subprocess.run(
        [sys.executable, "-c", QUANTIZE, str(source), str(target)], check=True, capture_output=True
    )


EVALUATE = """
import sys, numpy as np, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, logits_all=True, verbose=False, n_threads=2)
ids = [int(i) for i in sys.argv[3].split(",")]
llm.eval(ids)
np.save(sys.argv[2], np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor | None:
    """llama.cpp's logits for `ids` (L, V), from a process of its own; None if llama.cpp crashed."""
    out = path.with_suffix(".logits.npy")
    run = subprocess.run(
        [sys.executable, "-c", EVALUATE, str(path), str(out), ",".join(map(str, ids))], capture_output=True
    )
    return torch.from_numpy(np.load(out)) if run.returncode == 0 else None


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason=NO_LLAMA_CPP)
@pytest.mark.parametrize(
    "name,file_type",
    [("llama", "f16"), ("gpt2", "f16"), ("qwen2", "f16"), ("llama", "q8_0"), ("llama", "q4_k_m")],
)
def test_llama_cpp_loads_the_file_and_agrees(folder, tmp_path, name, file_type):
    path, _ = folder(name)
    out = tmp_path / "m.gguf"
    types = export_gguf(path, out, file_type, show_progress=False)
    ids = input_ids(1, 9)[0].tolist()
    theirs = llama_cpp_logits(out, ids)
    if theirs is None and file_type != "f16":
        export_gguf(path, tmp_path / "f16.gguf", "f16", show_progress=False)
        llama_quantize(tmp_path / "f16.gguf", tmp_path / "own.gguf")
        if llama_cpp_logits(tmp_path / "own.gguf", ids) is None:
            pytest.skip("this llama-cpp-python build crashes evaluating quantized files (its own Q4_K_M too)")
    assert theirs is not None, (
        f"llama.cpp could not evaluate the {file_type} file ({sorted(set(types.values()))})"
    )
    with torch.no_grad():
        ours = flashformer.from_pretrained(out, quantize=None)(torch.tensor([ids])).logits[0]  # dequantized
        kernels = flashformer.from_pretrained(out, quantize="gguf")(torch.tensor([ids])).logits[0]
    # llama.cpp computes on int8 activations (Q8_0 / Q8_K blocks) where a weight is quantized: its
    # distance to the dequantized model is that rounding, of the size our own int8-activation
    # kernels show on the same file; a misread block (a wrong scale, a swapped half) is far larger
    rounding = (kernels - ours).abs().max()
    print(f"{file_type}: llama.cpp {(ours - theirs).abs().max():.4f}, our kernels {rounding:.4f}")
    assert (ours - theirs).abs().max() < 2e-2 * ours.abs().max() + 2 * rounding


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason=NO_LLAMA_CPP)
def test_our_q4_k_m_is_as_good_as_llama_cpps(folder, tmp_path):
    path, model = folder("llama")
    export_gguf(path, tmp_path / "f16.gguf", "f16", show_progress=False)
    types = export_gguf(path, tmp_path / "ours.gguf", "q4_k_m", show_progress=False)
    llama_quantize(tmp_path / "f16.gguf", tmp_path / "theirs.gguf")
    ours, theirs = (read_gguf(tmp_path / f"{n}.gguf", show_progress=False) for n in ("ours", "theirs"))
    assert {n: r.ggml_type for n, r in read_file(tmp_path / "theirs.gguf").tensors.items()} == types
    state = model.state_dict()
    for name in ours.quantized:
        exact = state[name].half().float()  # llama.cpp quantized the f16 weights
        error = [(c.tensors[name] - exact).square().mean().sqrt() for c in (ours, theirs)]
        assert error[0] <= 1.005 * error[1], (name, float(error[0]), float(error[1]))
