"""Hugging Face checkpoints in and out: bert, gpt2, t5 (v1.0 and v1.1), llama, qwen2, phi3,
qwen3, qwen3_moe, gpt_oss, lfm2, gemma, gemma2, gemma3_text.

    config, state = read_pretrained("path/to/folder")      # config.json + weights, in our names
    save_pretrained(model, "path/to/out")                  # transformers loads it back
    hf_config, weights = to_hf(model)                      # the same, in memory

(flashformer.from_pretrained builds the model from what read_pretrained gives.)

A folder holds config.json and the weights as model.safetensors, a sharded
model.safetensors.index.json, pytorch_model.bin (read with
torch.load(weights_only=True)) or a sharded pytorch_model.bin.index.json.

Each family is a config translation plus a list of `Rule`s that map one of
our parameters to one or more of theirs. Loading applies the rules, then
insists that nothing is missing and nothing is left over (other than
buffers and aliases listed per family), so a mapping mistake or an
unsupported head is an error, never a silently different model. The traps:

- GPT-2 stores Conv1D weights as (in, out), transposed from nn.Linear, with
  q, k and v fused in c_attn; old files carry attn.bias / attn.masked_bias
  mask buffers; lm_head.weight is often absent (tied to wte).
- BERT is post-norm; old files name LayerNorm parameters gamma / beta; the
  MLM head's decoder weight is the word embedding and its bias is stored
  twice (cls.predictions.bias and cls.predictions.decoder.bias).
- T5 keeps the relative bias table in block 0 of each stack only, does not
  scale q.k by 1/sqrt(d), has d_kv * heads possibly != d_model, and (in
  transformers) folds the padding mask into that bias: here the mask goes
  to attention separately. With a tied head (v1.0) the decoder output is
  multiplied by d_model^-0.5; v1.1 (tie_word_embeddings=false) has its own
  lm_head and no rescale.
- LLaMA: grouped KV heads, rope_theta, rope_scaling (linear, llama3), old
  rotary inv_freq buffers. Qwen2: LLaMA with q/k/v biases and none on o_proj.
  Phi-3: q, k, v fused in qkv_proj, gate and up in gate_up_proj, partial rotary.
  Qwen3 MoE: a router and one tensor per expert and projection in the folder, which
  transformers fuses in memory. LFM2: conv layers (a short convolution's in_proj, conv and
  out_proj) beside attention layers, its final norm named embedding_norm.

A config option whose value changes the computation and that flashformer
does not implement raises a ValueError naming it.

The room: families.py (the table of families, a module each: bert.py, gpt2.py, t5.py, llama.py,
qwen2.py, phi3.py, qwen3.py, qwen3_moe.py, gpt_oss.py, lfm2.py, gemma.py; their naming rules in mapping.py), convert.py (reading
and writing through a family's rules), weight_files.py (the weight files of a folder).
"""

from flashformer.model.hf.convert import (
    config_from_hf,
    read_pretrained,
    save_pretrained,
    state_from_hf,
    to_hf,
)
from flashformer.model.hf.families import FAMILIES, family, names_table
from flashformer.model.hf.weight_files import load_weights

__all__ = [
    "FAMILIES",
    "config_from_hf",
    "family",
    "load_weights",
    "names_table",
    "read_pretrained",
    "save_pretrained",
    "state_from_hf",
    "to_hf",
]
