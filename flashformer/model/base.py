"""What every model of the library shares: the output record, the base class (config,
saving, counting, the input checks), the arch check and the loss. The families live in
models.py (the Transformers) and recurrent.py / ssm.py (the recurrent alternatives).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.checks import IGNORE_INDEX, check_int_tensor, check_token_ids
from flashformer.model import hf
from flashformer.model.config import ModelConfig


def check_arch(config: ModelConfig, arch: str) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig; got {type(config).__name__}")
    if config.arch != arch:
        raise ValueError(f"this model needs config.arch == {arch!r}; got {config.arch!r}")


@dataclass
class ModelOutput:
    """What a model returns; fields a model does not produce are None.

    last_hidden_state: (B, L, d_model), after the final norm (the decoder's, for T5).
    logits: (B, L, vocab_size) from the LM / masked-LM head; with a task head (task_heads.py)
        (B, num_labels) for sequence classification, (B, L, num_labels) for token classification.
    loss: mean cross-entropy over labels != -100, when labels are given (a task head's own loss).
    pooler_output: (B, d_model), an encoder's pooled [CLS] state.
    encoder_last_hidden_state: (B, M, d_model), the encoder's output in an encoder-decoder.
    attentions: with output_attentions=True, one (B, H, L, L_keys) tensor of
        attention probabilities per layer: the encoder's (BERT) or the decoder's
        self-attention (GPT-2, LLaMA, T5; transformers calls T5's decoder_attentions).
    encoder_attentions, cross_attentions: T5's encoder self-attention and its
        decoder's attention to the encoder output, (B, H, L, M) per layer.
    """

    last_hidden_state: Tensor
    logits: Tensor | None = None
    loss: Tensor | None = None
    pooler_output: Tensor | None = None
    encoder_last_hidden_state: Tensor | None = None
    attentions: tuple[Tensor, ...] | None = None
    encoder_attentions: tuple[Tensor, ...] | None = None
    cross_attentions: tuple[Tensor, ...] | None = None


class PreTrainedModel(nn.Module):
    """What the three models share: the config, saving, counting."""

    config: ModelConfig

    def save_pretrained(self, folder: str | Path) -> None:
        """Write config.json + model.safetensors that transformers loads into the same outputs."""
        if getattr(self, "quantization", None) is not None:
            raise ValueError(
                f"this model is quantized ({self.quantization}): save the float model it was loaded from instead"
            )
        hf.save_pretrained(self, folder)

    def train(self, mode: bool = True):
        """As nn.Module's, but a quantized model refuses training mode while any of its own
        parameters would train: its weights are integer buffers with no gradient (train the float
        model, then quantize it). A frozen quantized base with LoRA adapters beside it (parameters
        under a LoRALinear's `adapters`, adapters/) trains them alone, as QLoRA does."""
        base_trains = any(p.requires_grad and ".adapters." not in n for n, p in self.named_parameters())
        if mode and getattr(self, "quantization", None) is not None and base_trains:
            raise RuntimeError(
                f"this model is quantized ({self.quantization}) and cannot be trained: its weights are "
                "integer buffers with no gradient; train or fine-tune the float model, then quantize it, "
                "or train a LoRA adapter beside the frozen base (flashformer train --base MODEL --lora)"
            )
        return super().train(mode)

    def init_weights(self) -> None:
        """GPT-2's scheme: weights N(0, init_std), biases 0, norms (and Gemma 4's layer scales) 1; the
        projections that write into the residual stream (attn.out, a conv layer's attn.out_proj,
        ffn.down, each expert's down)
        get std / sqrt(2 * layers), so the stream's variance does not grow
        with depth. With scale_decoder_output (T5) the token embedding is
        N(0, 1): the d_model^-0.5 rescale before the tied head expects
        unit-scale embeddings."""
        std = self.config.init_std
        depth = self.config.n_layers + (
            self.config.n_decoder_layers if self.config.arch == "encoder-decoder" else 0
        )
        for name, parameter in self.named_parameters():
            if name.endswith(("norm.weight", "layer_scale")):
                nn.init.ones_(parameter)
            elif parameter.dim() == 1:
                nn.init.zeros_(parameter)
            elif name.endswith(("attn.out.weight", "attn.out_proj.weight", "ffn.down.weight")) or (
                ".ffn.experts." in name and name.endswith(".down.weight")  # each expert's down too
            ):
                nn.init.normal_(parameter, std=std / (2 * depth) ** 0.5)
            else:
                nn.init.normal_(parameter, std=std)
        if self.config.scale_decoder_output:
            nn.init.normal_(self.embeddings.tokens.weight, std=1.0)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _check_ids(self, name: str, ids: Tensor) -> None:
        check_token_ids(name, ids, self.config.vocab_size)

    def _positions(self, name: str, length: int, position_ids, cache_position: int, device) -> Tensor:
        """Positions of the new tokens: (L,) from cache_position, or the given (L,) / (B, L) position_ids."""
        if position_ids is None:
            self._check_learned_positions(name, cache_position + length - 1, length, cache_position)
            return torch.arange(cache_position, cache_position + length, device=device)
        check_int_tensor("position_ids", position_ids, "positions", dims=(1, 2))
        if position_ids.shape[-1] != length:
            raise ValueError(
                f"position_ids must give {length} positions per row; got shape {tuple(position_ids.shape)}"
            )
        if not torch.compiler.is_compiling():
            self._check_learned_positions(name, int(position_ids.max()), length, cache_position)
        return position_ids

    def _check_learned_positions(self, name: str, last: int, length: int, cache_position: int) -> None:
        if self.config.position == "learned" and last >= self.config.max_seq_len:
            raise ValueError(
                f"{name} reaches position {last}, beyond the {self.config.max_seq_len} learned positions "
                f"(max_seq_len); got length {length} after {cache_position} cached tokens"
            )


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean token cross-entropy in float32 over labels != -100."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )
