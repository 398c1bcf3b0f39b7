"""Shared by the GGUF, tokenizer and chat-template tests: the real SmolLM2 file and transformers'
reading of it (each loaded once per test session, however many modules use it), and small
synthetic GGUF files written with gguf.GGUFWriter the way llama.cpp's converter writes them."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from flashformer.checkpoints.gguf import read_gguf
from flashformer.checkpoints.gguf.packaged_models import gemma3_path as package_gemma3_path
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.checkpoints.gguf.tokenizer import byte_alphabet, tokenizer_from_metadata
from flashformer.text.tokenizer import Tokenizer

# ---- the real model (fails, not skips, without the package: smollm2_path names the pip command) ----


@functools.cache
def smollm2_checkpoint():
    return read_gguf(smollm2_path(), show_progress=False)


@functools.cache
def smollm2_model():
    """flashformer's float model of the file (its blocks dequantized), through the public loader."""
    import flashformer

    return flashformer.from_pretrained(smollm2_path(), quantize=None)  # the float path


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    return tokenizer_from_metadata(smollm2_checkpoint().metadata, source=str(smollm2_path()))


@functools.cache
def transformers_smollm2_model():
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


@functools.cache
def transformers_smollm2_tokenizer():
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ---- a tiny byte-level BPE vocabulary, for synthetic files ----

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKENS = ["<think>"]
MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "Ġ a",
    "i n",
    "Ġ Ġ",
    "ĠĠ ĠĠ",
    "e r",
    "Ġ s",
    "o n",
    "Ġa n",
    "Ġan d",
    "1 2",
    "Ġ 1",
    "Ċ Ċ",
]


def tiny_vocabulary() -> dict:
    """GGUF tokenizer metadata: control tokens, the 256 byte letters, the merged tokens, <think>."""
    letters = list(byte_alphabet().values())
    merged = [merge.replace(" ", "") for merge in MERGES]
    tokens = CONTROL_TOKENS + letters + merged + USER_TOKENS
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(letters) + len(merged)) + [4] * len(USER_TOKENS)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }


# ---- writing GGUF files ----


def k_quant_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks with sane scales: gguf cannot quantize to K types, so the codes are
    random bytes and the float16 scale fields (d, dmin) are set to small positive numbers.
    (rows, cols // 256 * block bytes) uint8."""
    block_bytes = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    scale_offsets = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[
        type_name
    ]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scales = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256)).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def encode_tensor(values: np.ndarray, type_name: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """The bytes a GGUF stores for float32 values in a type, and the raw type to declare."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_name == "F32":
        return values, None
    if type_name == "F16":
        return values.astype(np.float16), None
    qtype = GGMLQuantizationType[type_name]
    if type_name.endswith("_K") and values.ndim == 3:  # a mixture of experts' (experts, out, in)
        experts = [k_quant_blocks(type_name, *matrix.shape, seed=e) for e, matrix in enumerate(values)]
        return np.stack(experts), qtype
    if type_name.endswith("_K"):
        return k_quant_blocks(type_name, values.shape[0], values.shape[1]), qtype
    return gguf.quants.quantize(values, qtype), qtype


def ids_for(model, seed: int = 1) -> torch.Tensor:
    """Two random rows of 24 ids over the transformers `model`'s vocabulary."""
    return torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def add_metadata(writer, metadata: dict) -> None:
    """Each key to a gguf.GGUFWriter by its value's type: ints as uint32, as llama.cpp writes them."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def write_gguf(path: Path, arch: str, metadata: dict, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF file: metadata (ints as uint32, as llama.cpp writes them) and tensors given as
    float32 values with the type to store them in."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("synthetic")
    add_metadata(writer, metadata)
    for name, (values, type_name) in tensors.items():
        data, raw_dtype = encode_tensor(values, type_name)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: per head, the two halves of the head's dims
    become interleaved pairs (the layout ggml's RoPE reads)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_llama(
    tie: bool = False, hidden: int = 64, ff: int = 128, heads: int = 4, kv_heads: int = 2, seed: int = 0
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 so that a misplaced norm shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def decoder_outer_tensors(model, norm_offset: float = 0.0):
    """(config, state as numpy, the GGUF tensors outside the blocks) of a transformers decoder with
    `model.` names: the token table, the final norm (+ norm_offset: gemma stores 1 + w) and an
    untied head."""
    config, state = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"] + norm_offset,
    }
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    return config, state, tensors


def llama_tensors(model, types) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF tensors of a transformers LlamaForCausalLM; types(gguf name) -> the type to store it in."""
    config, state, tensors = decoder_outer_tensors(model)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        tensors.update(
            {
                f"blk.{i}.attn_norm.weight": state[f"{layer}.input_layernorm.weight"],
                f"blk.{i}.attn_q.weight": llama_cpp_permute(
                    state[f"{layer}.self_attn.q_proj.weight"], config.num_attention_heads
                ),
                f"blk.{i}.attn_k.weight": llama_cpp_permute(
                    state[f"{layer}.self_attn.k_proj.weight"], config.num_key_value_heads
                ),
                f"blk.{i}.attn_v.weight": state[f"{layer}.self_attn.v_proj.weight"],
                f"blk.{i}.attn_output.weight": state[f"{layer}.self_attn.o_proj.weight"],
                f"blk.{i}.ffn_norm.weight": state[f"{layer}.post_attention_layernorm.weight"],
                f"blk.{i}.ffn_gate.weight": state[f"{layer}.mlp.gate_proj.weight"],
                f"blk.{i}.ffn_up.weight": state[f"{layer}.mlp.up_proj.weight"],
                f"blk.{i}.ffn_down.weight": state[f"{layer}.mlp.down_proj.weight"],
            }
        )
    return {name: (values, "F32" if values.ndim == 1 else types(name)) for name, values in tensors.items()}


def llama_metadata(model) -> dict:
    config = model.config
    return {
        "llama.block_count": config.num_hidden_layers,
        "llama.context_length": config.max_position_embeddings,
        "llama.embedding_length": config.hidden_size,
        "llama.feed_forward_length": config.intermediate_size,
        "llama.attention.head_count": config.num_attention_heads,
        "llama.attention.head_count_kv": config.num_key_value_heads,
        "llama.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "llama.rope.dimension_count": config.hidden_size // config.num_attention_heads,
        **tiny_vocabulary(),
    }


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=1024,  # transformers' GGUF reader leaves n_positions at its default, 1024
        bos_token_id=1,
        eos_token_id=2,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.uniform_(-0.1, 0.1)
            elif ".ln_" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def gpt2_tensors(model, types) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF tensors of a transformers GPT2LMHeadModel: Conv1D weights written (out, in), as llama.cpp does."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if not k.endswith(".attn.bias")}
    tensors = {
        "token_embd.weight": state["transformer.wte.weight"],
        "position_embd.weight": state["transformer.wpe.weight"],
        "output_norm.weight": state["transformer.ln_f.weight"],
        "output_norm.bias": state["transformer.ln_f.bias"],
    }
    for i in range(model.config.n_layer):
        for gguf_name, hf_name, conv1d in (
            ("attn_norm", "ln_1", False),
            ("attn_qkv", "attn.c_attn", True),
            ("attn_output", "attn.c_proj", True),
            ("ffn_norm", "ln_2", False),
            ("ffn_up", "mlp.c_fc", True),
            ("ffn_down", "mlp.c_proj", True),
        ):
            weight = state[f"transformer.h.{i}.{hf_name}.weight"]
            tensors[f"blk.{i}.{gguf_name}.weight"] = weight.T.copy() if conv1d else weight
            tensors[f"blk.{i}.{gguf_name}.bias"] = state[f"transformer.h.{i}.{hf_name}.bias"]
    return {name: (values, "F32" if values.ndim == 1 else types(name)) for name, values in tensors.items()}


def gpt2_metadata(model) -> dict:
    config = model.config
    return {
        "gpt2.block_count": config.n_layer,
        "gpt2.context_length": config.n_positions,
        "gpt2.embedding_length": config.n_embd,
        "gpt2.feed_forward_length": 4 * config.n_embd,
        "gpt2.attention.head_count": config.n_head,
        "gpt2.attention.layer_norm_epsilon": float(config.layer_norm_epsilon),
        **tiny_vocabulary(),
    }


def cycle_types(*type_names: str):
    """types(name) for llama_tensors/gpt2_tensors: the 2-D tensors take the given types in turn."""
    order: dict[str, str] = {}

    def types(name: str) -> str:
        return order.setdefault(name, type_names[len(order) % len(type_names)])

    return types


def transformers_gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


# ---- the LLaMA-shaped architectures beside llama: qwen2, phi3, and Llama 3's rope_freqs ----


def _perturb_norms_and_biases(model):
    """Norms away from 1 and biases away from 0, so that a misplaced one shows."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.uniform_(-0.2, 0.2)
    return model.eval()


def tiny_qwen2(tie: bool = True, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=tie,
    )
    return _perturb_norms_and_biases(Qwen2ForCausalLM(config))


def qwen2_tensors(model, types) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF tensors of a transformers Qwen2ForCausalLM as llama.cpp writes them: the q/k rows as
    they are (ggml's NEOX RoPE reads transformers' rotate-half layout), q/k/v biases."""
    config, state, tensors = decoder_outer_tensors(model)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names = {
            "attn_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "attn_output.weight": "self_attn.o_proj.weight",
            "ffn_gate.weight": "mlp.gate_proj.weight",
            "ffn_up.weight": "mlp.up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight",
        }
        for p in "qkv":
            names[f"attn_{p}.weight"] = f"self_attn.{p}_proj.weight"
            names[f"attn_{p}.bias"] = f"self_attn.{p}_proj.bias"
        tensors.update({f"blk.{i}.{ours}": state[f"{layer}.{theirs}"] for ours, theirs in names.items()})
    return {name: (values, "F32" if values.ndim == 1 else types(name)) for name, values in tensors.items()}


def qwen2_metadata(model) -> dict:
    config = model.config
    return {
        "qwen2.block_count": config.num_hidden_layers,
        "qwen2.context_length": config.max_position_embeddings,
        "qwen2.embedding_length": config.hidden_size,
        "qwen2.feed_forward_length": config.intermediate_size,
        "qwen2.attention.head_count": config.num_attention_heads,
        "qwen2.attention.head_count_kv": config.num_key_value_heads,
        "qwen2.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "qwen2.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        **tiny_vocabulary(),
    }


def tiny_phi3(partial_rotary_factor: float = 1.0, tie: bool = False, seed: int = 0):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    config = Phi3Config(
        vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,  # heads of 16: a factor of 0.75 rotates 12 channels
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial_rotary_factor,
        },
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _perturb_norms_and_biases(Phi3ForCausalLM(config))


def phi3_tensors(model, types) -> dict[str, tuple[np.ndarray, str]]:
    """GGUF tensors of a transformers Phi3ForCausalLM: qkv_proj as attn_qkv, gate_up_proj as ffn_up."""
    config, state, tensors = decoder_outer_tensors(model)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        for ours, theirs in {
            "attn_norm.weight": "input_layernorm.weight",
            "attn_qkv.weight": "self_attn.qkv_proj.weight",
            "attn_output.weight": "self_attn.o_proj.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight",
        }.items():
            tensors[f"blk.{i}.{ours}"] = state[f"{layer}.{theirs}"]
    return {name: (values, "F32" if values.ndim == 1 else types(name)) for name, values in tensors.items()}


def phi3_metadata(model, sliding_window: int = 8) -> dict:
    """As llama.cpp's converter writes a Phi-3-mini-4k file, with a window shorter than the tests'
    sequences (read, not applied: llama.cpp turns Phi-3's window off)."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return {
        "phi3.context_length": config.max_position_embeddings,
        "phi3.rope.scaling.original_context_length": config.original_max_position_embeddings,
        "phi3.embedding_length": config.hidden_size,
        "phi3.feed_forward_length": config.intermediate_size,
        "phi3.block_count": config.num_hidden_layers,
        "phi3.attention.head_count": config.num_attention_heads,
        "phi3.attention.head_count_kv": config.num_key_value_heads,
        "phi3.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "phi3.rope.dimension_count": int(head_dim * config.rope_parameters["partial_rotary_factor"]),
        "phi3.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "phi3.attention.sliding_window": sliding_window,
        **tiny_vocabulary(),
    }


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # short, so that the tests' positions turn the divided frequencies visibly
    "original_max_position_embeddings": 64,
}


def tiny_llama3(seed: int = 0):
    """A Llama 3.1-style model: llama3 rope scaling, heads of 32 (16 frequencies: 2 blended)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=True,
    )
    return _perturb_norms_and_biases(LlamaForCausalLM(config))


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it from Llama 3's rope_scaling: per
    frequency 1 (short waves), factor (long waves), or the blend between, in float32."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    wavelength = 2 * torch.pi / freqs
    original, low, high = (
        rope["original_max_position_embeddings"],
        rope["low_freq_factor"],
        rope["high_freq_factor"],
    )
    smooth = (original / wavelength - low) / (high - low)
    blended = 1 / ((1 - smooth) / rope["factor"] + smooth)
    divisors = torch.where(
        wavelength < original / high,
        torch.ones_like(freqs),
        torch.where(wavelength > original / low, torch.full_like(freqs, rope["factor"]), blended),
    )
    return divisors.numpy().astype(np.float32)


# ---- qwen3 and the gemmas: transformers' random models and their GGUF files ----

NEW_DECODER_SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # its own: 4 heads of 32 are not d_model
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
GEMMA2_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# per architecture: GGUF norm name -> transformers' name under a layer
DECODER_NORMS = {
    "qwen3": {
        "attn_norm": "input_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_norm": "post_attention_layernorm",
    },
    "gemma": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "gemma2": GEMMA2_NORMS,
    "gemma3": {**GEMMA2_NORMS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
SLIDING_WINDOW = 5  # shorter than the tests' sequences, so that the window matters
GEMMA3_PATTERN = 3  # two sliding layers, then a full one


def gemma3_layer_types(layers: int, pattern: int = GEMMA3_PATTERN) -> list[str]:
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def tiny_new_decoder(arch: str, seed: int = 0, rope_scaling: dict | None = None, **overrides):
    """A random transformers model of `arch` (qwen3, gemma, gemma2, gemma3) of NEW_DECODER_SIZES,
    its norms away from their resting value so that a misplaced norm (or a lost 1 + w) shows;
    gemma2's softcaps small enough to bend the scores. Eager attention: transformers' reference.
    rope_scaling: gemma3's scaling of its full layers' RoPE (transformers' rope_scaling)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GemmaConfig,
        GemmaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    sizes = dict(NEW_DECODER_SIZES, vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]))
    window = dict(sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=24)
    config = {
        "qwen3": lambda: Qwen3Config(**sizes, rope_theta=50000.0, tie_word_embeddings=False),
        "gemma": lambda: GemmaConfig(**sizes),
        "gemma2": lambda: Gemma2Config(
            **sizes, **window, attn_logit_softcapping=0.5, final_logit_softcapping=1.5
        ),
        "gemma3": lambda: Gemma3TextConfig(
            **sizes,
            **window,
            layer_types=gemma3_layer_types(sizes["num_hidden_layers"]),
            **({"rope_scaling": rope_scaling} if rope_scaling else {}),
        ),
    }[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    model_class = {
        "qwen3": Qwen3ForCausalLM,
        "gemma": GemmaForCausalLM,
        "gemma2": Gemma2ForCausalLM,
        "gemma3": Gemma3ForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # gemma's w in -0.5..0.5 is a scale of 0.5..1.5, as qwen3's
                parameter.uniform_(-0.5, 0.5) if arch.startswith("gemma") else parameter.uniform_(0.5, 1.5)
    return model


def new_decoder_tensors(model, arch: str) -> dict[str, tuple[np.ndarray, str]]:
    """The F32 GGUF tensors llama.cpp's converter writes for a qwen3 / gemma model: no q/k row
    permutation (these use half-split RoPE), gemma's norms stored as 1 + w."""
    offset = 1.0 if arch.startswith("gemma") else 0.0
    config, state, tensors = decoder_outer_tensors(model, norm_offset=offset)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        for gguf_name, hf_name in (
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ):
            tensors[f"blk.{i}.{gguf_name}.weight"] = state[f"{layer}.{hf_name}.weight"]
        for gguf_name, hf_name in DECODER_NORMS[arch].items():
            tensors[f"blk.{i}.{gguf_name}.weight"] = state[f"{layer}.{hf_name}.weight"] + offset
    return {name: (values, "F32") for name, values in tensors.items()}


def new_decoder_metadata(model, arch: str) -> dict:
    """The metadata llama.cpp writes for the model (the keys of its converter, uint32 ints)."""
    config = model.config
    metadata = {
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": config.head_dim,
        f"{arch}.attention.value_length": config.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        **tiny_vocabulary(),
    }
    if arch == "qwen3":
        metadata["qwen3.rope.freq_base"] = float(config.rope_parameters["rope_theta"])
    if arch == "gemma2":
        metadata.update(
            {
                "gemma2.attention.sliding_window": config.sliding_window,
                "gemma2.attn_logit_softcapping": float(config.attn_logit_softcapping),
                "gemma2.final_logit_softcapping": float(config.final_logit_softcapping),
            }
        )
    if arch == "gemma3":
        metadata.update(
            {
                "gemma3.attention.sliding_window": config.sliding_window,
                "gemma3.attention.sliding_window_pattern": GEMMA3_PATTERN,
                "gemma3.rope.freq_base": float(config.rope_parameters["full_attention"]["rope_theta"]),
            }
        )
    return metadata


def transformers_gguf_overrides(model) -> dict:
    """The config values transformers' GGUF reader does not take from the file and must be
    given (its defaults are a real model's: head_dim 256, query_pre_attn_scalar 256, ...)."""
    config = model.config
    overrides = {"head_dim": config.head_dim}
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "layer_types"):
        if hasattr(config, key):
            overrides[key] = getattr(config, key)
    return overrides


def gemma3_path() -> Path:
    """The real Gemma 3 270M Q4_K_M file (the package's finder, which names the pip command)."""
    return package_gemma3_path()


# ---- qwen3moe: transformers' Qwen3MoeForCausalLM and its GGUF file ----


def tiny_qwen3_moe(seed: int = 0, norm_topk_prob: bool = True, **overrides):
    """A random transformers Qwen3MoeForCausalLM: 2 layers of 8 experts of 32, 2 per token, its
    norms away from 1 and its router's weights large enough that each token's choice is clear
    (at init every expert is about as likely, and a rounding could swap two)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    values = dict(
        vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = Qwen3MoeConfig(**{**values, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # the router
                parameter.normal_(0.0, 0.5)
            else:
                parameter.add_(torch.randn_like(parameter) * 0.02)
    return model


def qwen3moe_tensors(model, expert_types=("F32", "F32", "F32")) -> dict[str, tuple[np.ndarray, str]]:
    """The GGUF tensors llama.cpp's converter writes for a Qwen3MoeForCausalLM (its names, checked
    against a file of the converter itself): qwen3's attention and norms, the router
    ffn_gate_inp and the experts stacked in 3-D ffn_gate_exps / ffn_up_exps / ffn_down_exps
    (experts, out, in), stored in expert_types (gate, up, down); everything else F32."""
    config, state, tensors = decoder_outer_tensors(model)
    types = {}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        for gguf_name, hf_name in (
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate_inp", "mlp.gate"),
        ):
            tensors[f"blk.{i}.{gguf_name}.weight"] = state[f"{layer}.{hf_name}.weight"]
        for gguf_name, hf_name in DECODER_NORMS["qwen3"].items():
            tensors[f"blk.{i}.{gguf_name}.weight"] = state[f"{layer}.{hf_name}.weight"]
        # transformers holds the experts fused in memory: gate rows then up rows, and down
        gate, up = np.split(state[f"{layer}.mlp.experts.gate_up_proj"], 2, axis=1)  # (experts, ff, d) each
        down = state[f"{layer}.mlp.experts.down_proj"]  # (experts, d, ff)
        for gguf_name, values, type_name in zip(
            ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), (gate, up, down), expert_types
        ):
            tensors[f"blk.{i}.{gguf_name}.weight"] = np.ascontiguousarray(values)
            types[f"blk.{i}.{gguf_name}.weight"] = type_name
    return {name: (values, types.get(name, "F32")) for name, values in tensors.items()}


def qwen3moe_metadata(model) -> dict:
    """The metadata llama.cpp's converter writes for a Qwen3MoeForCausalLM (its keys; it writes
    none for norm_topk_prob, which llama.cpp's qwen3moe always applies)."""
    config = model.config
    return {
        **new_decoder_metadata(model, "qwen3moe"),
        "qwen3moe.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "qwen3moe.expert_count": config.num_experts,
        "qwen3moe.expert_used_count": config.num_experts_per_tok,
        "qwen3moe.expert_feed_forward_length": config.moe_intermediate_size,
    }
