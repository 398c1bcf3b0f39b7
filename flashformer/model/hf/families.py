"""The one table of Hugging Face families (FAMILIES: config.json's model_type -> its Family,
a module each: bert.py, gpt2.py, ...), and the names table of docs/models.md drawn from it.
Adding a family is its module and a row."""

from __future__ import annotations

from flashformer.formatting import markdown_table
from flashformer.model.hf.bert import Bert
from flashformer.model.hf.gemma import Gemma
from flashformer.model.hf.gemma4 import Gemma4, Gemma4Multimodal
from flashformer.model.hf.gpt2 import GPT2
from flashformer.model.hf.gpt_oss import GptOss
from flashformer.model.hf.lfm2 import Lfm2
from flashformer.model.hf.llama import Llama
from flashformer.model.hf.mapping import Family
from flashformer.model.hf.phi3 import Phi3
from flashformer.model.hf.qwen2 import Qwen2
from flashformer.model.hf.qwen3 import Qwen3
from flashformer.model.hf.qwen3_moe import Qwen3Moe
from flashformer.model.hf.smollm3 import SmolLM3
from flashformer.model.hf.t5 import T5
from flashformer.model.presets import preset

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Bert(),
        GPT2(),
        T5(),
        Llama(),
        Qwen2(),
        Phi3(),
        Qwen3(),
        Qwen3Moe(),
        GptOss(),
        Lfm2(),
        Gemma("gemma", 1),
        Gemma("gemma2", 2),
        Gemma("gemma3_text", 3),
        SmolLM3(),
        Gemma4(),
        Gemma4Multimodal(),
    )
}


def family(model_type) -> Family:
    """The family of a config.json's model_type; a ValueError names the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def names_table() -> str:
    """Our parameter names against those in an HF checkpoint file, for one layer
    of each family, from flashformer.model.hf's rules (and its prefixes: "bert.",
    "transformer.", "model.")."""

    sections = []
    configs = {
        "bert": preset("bert-tiny", n_layers=1),
        "gpt2": preset("gpt2-tiny", n_layers=1),
        "t5": preset("t5-tiny", n_layers=1, n_decoder_layers=1),
        "llama": preset("llama-tiny", n_layers=1),
        "qwen2": preset(
            "llama-tiny", n_layers=1, hf_model_type="qwen2", attention_bias=True, attention_out_bias=False
        ),
        "phi3": preset("llama-tiny", n_layers=1, hf_model_type="phi3", fused_gate_up=True),
        "qwen3": preset("llama-tiny", n_layers=1, qk_norm=True, hf_model_type="qwen3"),
        "smollm3": preset("llama-tiny", n_layers=1, nope_layers=(0,), hf_model_type="smollm3"),
        "qwen3_moe": preset(
            "llama-tiny", n_layers=1, qk_norm=True, n_expert=2, n_expert_used=1, hf_model_type="qwen3_moe"
        ),
        "gpt_oss": preset(
            "llama-tiny",
            n_layers=1,
            hf_model_type="gpt_oss",
            attention_bias=True,
            attention_sinks=True,
            layer_types=("sliding_attention",),
            sliding_window=4,
            swiglu_limit=7.0,
            swiglu_alpha=1.702,
            n_expert=2,
            n_expert_used=1,
            expert_gating="topk_softmax",
            expert_router_bias=True,
        ),
        "lfm2": preset(
            "llama-tiny",
            n_layers=2,
            qk_norm=True,
            attention_bias=False,
            layer_types=("conv", "full_attention"),
            hf_model_type="lfm2",
        ),
    }
    gemma = dict(
        n_layers=1,
        activation="gelu_tanh",
        tie_word_embeddings=True,
        scale_embeddings=True,
        hf_model_type="gemma",
    )
    configs["gemma"] = preset("llama-tiny", **gemma)
    gemma.update(sandwich_norm=True, sliding_window=4, layer_types=("sliding_attention",))
    configs["gemma2"] = preset("llama-tiny", **dict(gemma, hf_model_type="gemma2"))
    configs["gemma3_text"] = preset("llama-tiny", **dict(gemma, qk_norm=True, hf_model_type="gemma3_text"))
    gemma.update(qk_norm=True, v_norm=True, layer_scale=True, attention_scale=1.0, per_layer_input_dim=4)
    configs["gemma4_text"] = preset("llama-tiny", **dict(gemma, hf_model_type="gemma4_text"))
    configs["gemma4"] = configs["gemma4_text"]  # its text model, under model.language_model.
    for family, config in configs.items():
        layout = FAMILIES[family]
        rules = layout.rules(config)
        # the names as a checkpoint file holds them, with the family's prefixes
        in_file = {name: layout.file_name(name, config) for r in rules for name in r.theirs}
        rows = [[f"`{rule.ours}`", ", ".join(f"`{in_file[name]}`" for name in rule.theirs)] for rule in rules]
        sections.append(f"**{family}**\n\n" + markdown_table(["flashformer", "transformers"], rows))
    return "\n\n".join(sections)
