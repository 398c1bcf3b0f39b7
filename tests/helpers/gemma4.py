"""A small random Gemma 4 text model of transformers' own class, for the gemma4 tests: sliding
and full layers (the full ones' heads 512 wide, past the attention kernels' 256), per-layer
inputs, the last two layers reading the keys and values of earlier ones with double-wide
feed-forwards, a final-logit softcap small enough to bend the logits, and every weight, norm and
layer scale moved away from its initial value so that no part is an identity."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

LAYER_TYPES = ["sliding_attention", "full_attention"] * 3  # the last own layer full (llama.cpp reads it so)


def tiny_gemma4(seed: int = 0, **overrides):
    """transformers' Gemma4ForCausalLM (eager attention, eval mode) with random weights."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    sizes = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=512,
        sliding_window=5,
        layer_types=LAYER_TYPES,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=160,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        final_logit_softcapping=3.0,
        max_position_embeddings=256,
    )
    sizes.update(overrides)
    config = Gemma4TextConfig(**sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # an attention scale of 1: scores of
                parameter.uniform_(0.1, 0.3)  # unit-RMS heads grow with sqrt(512); these keep them O(1)
            elif "norm" in name:  # Gemma 4 scales by w itself: 0.5..1.5
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


# ---- llama.cpp's own files: its converter on a folder, its quantizer and llama-perplexity ----


def byte_fallback_tokenizer():
    """A small SentencePiece-style BPE (spaces as ▁, bytes as <0xNN>, a few merges): the vocabulary
    kind llama.cpp's gemma4 converter takes (it refuses GPT-2-style byte-level BPE)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    for piece in "▁abcdefghijklmnopqrstuvwxyz.,":
        vocab.setdefault(piece, len(vocab))
    merges = [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("i", "n"),
        ("a", "n"),
        ("e", "r"),
        ("o", "n"),
        ("r", "e"),
    ]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )


def gemma4_folder(path: Path, **overrides):
    """tiny_gemma4 with the tokenizer's vocabulary, saved beside it; returns the model."""
    tokenizer = byte_fallback_tokenizer()
    vocab = len(tokenizer)
    model = tiny_gemma4(vocab_size=vocab, vocab_size_per_layer_input=vocab, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def llama_cpp_tree() -> Path | None:
    """A llama.cpp source tree with the gemma4 converter (FLASHFORMER_LLAMA_CPP_TREE, the tree
    above FLASHFORMER_LLAMA_CPP_DIR, or the usual places of this machine), or None."""
    build = os.environ.get("FLASHFORMER_LLAMA_CPP_DIR")
    candidates = [os.environ.get("FLASHFORMER_LLAMA_CPP_TREE"), build and str(Path(build).parent)]
    candidates += ["/work/llama.cpp", *sorted(glob.glob("/work/peer/llama_cpp_python-*/vendor/llama.cpp"))]
    for folder in filter(None, candidates):
        tree = Path(folder)
        if (tree / "convert_hf_to_gguf.py").is_file() and "Gemma4Model" in _text(
            tree / "conversion" / "gemma.py"
        ):
            return tree
    return None


def llama_cpp_binary(name: str) -> Path | None:
    """bin/NAME of a llama.cpp build (FLASHFORMER_LLAMA_CPP_DIR, else the tree's build-native)."""
    tree = llama_cpp_tree()
    folders = [os.environ.get("FLASHFORMER_LLAMA_CPP_DIR"), tree and str(tree / "build-native")]
    for folder in filter(None, folders):
        for path in (Path(folder) / "bin" / name, Path(folder) / name):
            if path.is_file():
                return path
    return None


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `folder`, with its tree's gguf-py first on the path."""
    tree = llama_cpp_tree()
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))
    script = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype]
    done = subprocess.run(
        [*script, "--outfile", str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


# ---- the same file written here (no llama.cpp needed): the converter's names and keys ----

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "layer_scalar": "layer_output_scale",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
}
OUTER_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
    "model.norm.weight": "output_norm.weight",
}


def gemma4_tensors(model, weight_type: str = "F32") -> dict:
    """GGUF name -> (float32 values, type): 2-D weights in weight_type, the rest F32."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        if name in OUTER_NAMES:
            gguf_name = OUTER_NAMES[name]
        else:
            _, _, index, rest = name.split(".", 3)
            rest = rest.removesuffix(".weight")
            gguf_name = f"blk.{index}.{LAYER_NAMES[rest]}.weight"
        values = tensor.detach().float().numpy()
        tensors[gguf_name] = (values, weight_type if values.ndim == 2 else "F32")
    config = model.config
    full = config.rope_parameters["full_attention"]
    turning = int(full["partial_rotary_factor"] * 512 // 2)
    divisors = [1.0] * turning + [1e30] * (512 // 2 - turning)
    tensors["rope_freqs.weight"] = (np.array(divisors, dtype=np.float32), "F32")
    return tensors


def gemma4_metadata(model) -> dict:
    """The gemma4.* keys llama.cpp's converter writes for this model (global heads of 512)."""
    config = model.config
    swa_dim = model.model.layers[0].self_attn.head_dim  # config.head_dim is ambiguous: per layer
    n_layers, shared = config.num_hidden_layers, config.num_kv_shared_layers
    widths = [config.intermediate_size * (2 if i >= n_layers - shared else 1) for i in range(n_layers)]
    return {
        "gemma4.block_count": n_layers,
        "gemma4.vocab_size": config.vocab_size,
        "gemma4.context_length": config.max_position_embeddings,
        "gemma4.embedding_length": config.hidden_size,
        "gemma4.feed_forward_length": widths,
        "gemma4.attention.head_count": config.num_attention_heads,
        "gemma4.attention.head_count_kv": config.num_key_value_heads,
        "gemma4.rope.freq_base": 1e6,
        "gemma4.rope.freq_base_swa": 10000.0,
        "gemma4.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "gemma4.attention.key_length": 512,
        "gemma4.attention.value_length": 512,
        "gemma4.final_logit_softcapping": float(config.final_logit_softcapping),
        "gemma4.attention.sliding_window": config.sliding_window,
        "gemma4.attention.shared_kv_layers": shared,
        "gemma4.embedding_length_per_layer_input": config.hidden_size_per_layer_input,
        "gemma4.attention.sliding_window_pattern": [t == "sliding_attention" for t in config.layer_types],
        "gemma4.attention.key_length_swa": swa_dim,
        "gemma4.attention.value_length_swa": swa_dim,
        "gemma4.rope.dimension_count": 512,
        "gemma4.rope.dimension_count_swa": swa_dim,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.padding_token_id": 0,
    }
