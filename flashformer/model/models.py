"""The three model families: EncoderModel (BERT), DecoderModel (GPT-2,
LLaMA) and EncoderDecoderModel (T5), built from one ModelConfig.

    model = flashformer.build("gpt2")                    # a preset, randomly initialized
    out = model(input_ids, attention_mask=mask, labels=input_ids)
    out.logits, out.last_hidden_state, out.loss

Every forward checks its inputs (ids in range, masks shaped like the ids,
sequences within the learned positions) before any computation and raises a
ValueError that names the argument (see flashformer.checks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from flashformer.checks import (
    IGNORE_INDEX,
    check_caches,
    check_int_tensor,
    check_labels,
    check_logits_to_keep,
    check_token_types,
    padding_mask_from,
)
from flashformer.generate.mixin import GenerationMixin
from flashformer.kernels.cpu import Linear, linear
from flashformer.model.base import ModelOutput, PreTrainedModel, check_arch, cross_entropy
from flashformer.model.config import ModelConfig
from flashformer.model.heads import MaskedLMHead, Pooler, make_task_head
from flashformer.model.layers import Softcap, recording_attention
from flashformer.model.native import native_decoder
from flashformer.model.per_layer import PerLayerInputs
from flashformer.model.presets import preset
from flashformer.model.recurrent import GRUModel, LSTMModel
from flashformer.model.ssm import SSMModel
from flashformer.model.stacks import Decoder, Embeddings, Encoder


def _maps(maps, kind: str) -> tuple[Tensor, ...] | None:
    """The recorded maps of one kind ("encoder", "decoder", "cross"), or None when not recorded."""
    return None if maps is None else tuple(getattr(maps, kind))


# ---- models ----


class EncoderModel(PreTrainedModel):
    """BERT-style: embeddings with token types, a bidirectional encoder, and
    optionally the [CLS] pooler and the masked-LM head, or a task head (config.task)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_arch(config, "encoder")
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if config.pooler else None
        self.mlm_head = MaskedLMHead(config) if config.mlm_head else None
        self.task_head = make_task_head(config)  # sequence / token classification, or None
        self.init_weights()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool = False,
    ) -> ModelOutput:
        """input_ids (B, L); attention_mask (B, L), 1/True = real token; token_type_ids (B, L);
        labels (B, L) with -100 where no prediction is scored (a task head's labels: task_heads.py).
        output_attentions: also return every layer's attention probabilities (computed by the
        eager backend)."""
        self._check_ids("input_ids", input_ids)
        padding_mask = padding_mask_from("attention_mask", attention_mask, tuple(input_ids.shape))
        check_token_types(token_type_ids, input_ids, self.config.type_vocab_size)
        if self.task_head is None:  # a task head checks its own labels
            check_labels(labels, tuple(input_ids.shape), self.config.vocab_size, self.mlm_head is not None)
        positions = self._positions("input_ids", input_ids.shape[1], position_ids, 0, input_ids.device)

        hidden = self.embeddings(input_ids, positions, token_type_ids)  # (B, L, d_model)
        with recording_attention(output_attentions) as maps:
            hidden = self.encoder(hidden, padding_mask, positions)
        pooled = self.pooler(hidden) if self.pooler is not None else None
        if self.task_head is not None:
            logits, loss = self.task_head(hidden, pooled, padding_mask, labels)
        else:
            logits = (
                self.mlm_head(hidden, self.embeddings.tokens.weight) if self.mlm_head is not None else None
            )
            loss = cross_entropy(logits, labels) if labels is not None else None
        return ModelOutput(
            last_hidden_state=hidden,
            logits=logits,
            loss=loss,
            pooler_output=pooled,
            attentions=_maps(maps, "encoder"),
        )


class DecoderModel(GenerationMixin, PreTrainedModel):
    """GPT-2 / LLaMA style: embeddings, a causal decoder, and an LM head tied
    to the token embedding or its own."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_arch(config, "decoder")
        self.config = config
        self.embeddings = Embeddings(config)
        self.per_layer_inputs = PerLayerInputs(config) if config.per_layer_input_dim else None
        self.decoder = Decoder(config, config.n_layers)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.logit_softcap = (
            Softcap(config.final_logit_softcap) if config.final_logit_softcap is not None else nn.Identity()
        )
        self.init_weights()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        kv_caches: list | None = None,
        cache_position: int = 0,
        token_type_ids: Tensor | None = None,
        logits_to_keep: int = 0,
        output_attentions: bool = False,
    ) -> ModelOutput:
        """input_ids (B, L): the new tokens (all of them without a cache).

        attention_mask: (B, cache_position + L), 1/True = real token, over cached and new tokens.
        position_ids: (B, L) or (L,); default cache_position .. cache_position + L - 1.
        labels: (B, L); the loss predicts token t+1 from tokens <= t (shifted inside, as in transformers).
        kv_caches, cache_position: one cache per layer (flashformer.generate.cache) and how many tokens it holds.
        output_attentions: also return every layer's attention probabilities (eager backend).
        logits_to_keep: compute the logits of the last n positions only (0 = all), as in
            transformers; generation needs only the last one, and the head is the largest matmul.
        """
        self._check_ids("input_ids", input_ids)
        batch, length = input_ids.shape
        padding_mask = padding_mask_from("attention_mask", attention_mask, (batch, cache_position + length))
        check_token_types(token_type_ids, input_ids, self.config.type_vocab_size)
        check_labels(labels, (batch, length), self.config.vocab_size)
        check_caches(kv_caches, self.config.n_layers)
        check_logits_to_keep(logits_to_keep, length, labels)
        positions = self._positions("input_ids", length, position_ids, cache_position, input_ids.device)

        hidden = self.embeddings(input_ids, positions, token_type_ids)  # (B, L, d_model)
        per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(input_ids, hidden)
        with recording_attention(output_attentions) as maps:
            hidden = self.decoder(
                hidden,
                padding_mask,
                positions,
                kv_caches=kv_caches,
                cache_position=cache_position,
                per_layer_inputs=per_layer,
            )
        logits = self.project(hidden[:, -logits_to_keep:])  # (B, L or logits_to_keep, vocab)
        loss = None
        if labels is not None:
            # position t predicts label t+1: shift the labels, not the (large) logits
            loss = cross_entropy(logits, F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:])
        return ModelOutput(
            last_hidden_state=hidden, logits=logits, loss=loss, attentions=_maps(maps, "decoder")
        )

    def project(self, hidden: Tensor) -> Tensor:
        """The LM head: hidden (B, L, d_model) -> logits (B, L, vocab). Tied to the token
        embedding unless the model has its own head (a quantized model always has one: the
        embedding's packed bytes read as a matrix, kernels.quantized); then the final-logit
        softcap where the model has one (Gemma 2)."""
        if self.lm_head is not None:
            return self.logit_softcap(self.lm_head(hidden))
        return self.logit_softcap(linear(hidden, self.embeddings.tokens.weight))

    @property
    def output_embedding(self) -> Tensor:
        return self.embeddings.tokens.weight if self.lm_head is None else self.lm_head.weight

    def native_decoder(self):
        """This model's forward as one native call (model/native.py, kernels/native_decoder.py),
        built on first use; None where it has no native form here (native.native_unsupported says
        why: another device or dtype, training mode, a layer it does not know)."""
        return native_decoder(self)


class EncoderDecoderModel(GenerationMixin, PreTrainedModel):
    """T5 style: one token embedding shared by the encoder, the decoder and
    (when tied) the LM head; the decoder cross-attends to the encoder's output.
    With scale_decoder_output the decoder's output is multiplied by
    d_model^-0.5 before the head, which T5 does when the head is tied."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_arch(config, "encoder-decoder")
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config, config.n_decoder_layers, cross_attention=True)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.output_scale = config.d_model**-0.5 if config.scale_decoder_output else 1.0
        self.init_weights()

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """input_ids (B, M) -> the encoder's output (B, M, d_model)."""
        self._check_ids("input_ids", input_ids)
        padding_mask = padding_mask_from("attention_mask", attention_mask, tuple(input_ids.shape))
        return self._encode(input_ids, padding_mask)

    def _encode(self, input_ids: Tensor, padding_mask: Tensor | None) -> Tensor:
        positions = self._positions("input_ids", input_ids.shape[1], None, 0, input_ids.device)
        return self.encoder(self.embeddings(input_ids, positions), padding_mask, positions)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        decoder_attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        encoder_outputs: Tensor | ModelOutput | None = None,
        kv_caches: list | None = None,
        cache_position: int = 0,
        logits_to_keep: int = 0,
        output_attentions: bool = False,
    ) -> ModelOutput:
        """input_ids (B, M) and attention_mask (B, M) for the encoder;
        decoder_input_ids (B, L) and decoder_attention_mask (B, cache_position + L) for the decoder.

        Without decoder_input_ids, labels (B, L) shifted right (starting with
        decoder_start_token_id) become them, as in transformers. encoder_outputs
        (the encoder's output, or a ModelOutput holding it) skips the encoder.
        kv_caches, cache_position, logits_to_keep: as in DecoderModel.forward; the
        caches also keep the cross-attention keys and values after the first call.
        output_attentions: also return the attention probabilities of every
        layer (eager backend): decoder self-attention, encoder, cross-attention.
        """
        if decoder_input_ids is None and labels is None:
            raise ValueError(
                "EncoderDecoderModel needs decoder_input_ids (or labels, which are shifted right to make them); "
                "got neither"
            )
        if input_ids is None and encoder_outputs is None:
            raise ValueError("EncoderDecoderModel needs input_ids (or encoder_outputs); got neither")
        if decoder_input_ids is None:
            check_int_tensor("labels", labels, "token ids")
            check_labels(labels, tuple(labels.shape), self.config.vocab_size)
            decoder_input_ids = self.shift_right(labels)
        self._check_ids("decoder_input_ids", decoder_input_ids)
        batch, length = decoder_input_ids.shape
        decoder_padding = padding_mask_from(
            "decoder_attention_mask", decoder_attention_mask, (batch, cache_position + length)
        )
        check_labels(labels, (batch, length), self.config.vocab_size)
        check_caches(kv_caches, self.config.n_decoder_layers)
        check_logits_to_keep(logits_to_keep, length, labels)
        encoder_maps = None  # the encoder's attention maps, when it runs here
        if encoder_outputs is None:
            self._check_ids("input_ids", input_ids)
            memory_padding = padding_mask_from("attention_mask", attention_mask, tuple(input_ids.shape))
            with recording_attention(output_attentions) as encoder_maps:
                memory = self._encode(input_ids, memory_padding)  # (B, M, d_model)
        else:
            memory = (
                encoder_outputs.last_hidden_state
                if isinstance(encoder_outputs, ModelOutput)
                else encoder_outputs
            )
            memory_padding = padding_mask_from("attention_mask", attention_mask, tuple(memory.shape[:2]))
        positions = self._positions(
            "decoder_input_ids", length, None, cache_position, decoder_input_ids.device
        )

        hidden = self.embeddings(decoder_input_ids, positions)  # (B, L, d_model)
        with recording_attention(output_attentions) as maps:
            hidden = self.decoder(
                hidden,
                decoder_padding,
                positions,
                memory=memory,
                memory_padding_mask=memory_padding,
                kv_caches=kv_caches,
                cache_position=cache_position,
            )
        kept = hidden[:, -logits_to_keep:]  # (B, L or logits_to_keep, d_model)
        logits = linear(kept * self.output_scale, self.output_embedding)  # (B, L or logits_to_keep, vocab)
        loss = cross_entropy(logits, labels) if labels is not None else None
        return ModelOutput(
            last_hidden_state=hidden,
            logits=logits,
            loss=loss,
            encoder_last_hidden_state=memory,
            attentions=_maps(maps, "decoder"),
            encoder_attentions=_maps(encoder_maps, "encoder"),
            cross_attentions=_maps(maps, "cross"),
        )

    @property
    def output_embedding(self) -> Tensor:
        return self.embeddings.tokens.weight if self.lm_head is None else self.lm_head.weight

    def shift_right(self, labels: Tensor) -> Tensor:
        """decoder_start_token_id, then labels[:, :-1], with -100 replaced by the pad token."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError(
                "shifting labels into decoder_input_ids needs config.decoder_start_token_id and "
                f"config.pad_token_id; got {start} and {pad}"
            )
        shifted = torch.cat((torch.full_like(labels[:, :1], start), labels[:, :-1]), dim=1)
        return shifted.masked_fill(shifted == IGNORE_INDEX, pad)


MODEL_CLASSES = {
    "encoder": EncoderModel,
    "decoder": DecoderModel,
    "encoder-decoder": EncoderDecoderModel,
    "lstm": LSTMModel,
    "gru": GRUModel,
    "ssm": SSMModel,
}


def build_with_weights(config: ModelConfig, weights: dict[str, Tensor]) -> PreTrainedModel:
    """The model of `config` holding exactly `weights` (our parameter names),
    in eval mode: built on the meta device, so nothing is randomly initialized
    and no memory is taken until the weights arrive; a missing or unexpected
    name is an error (load_state_dict's, strict)."""
    with torch.device("meta"), _NoInitialization():
        model = MODEL_CLASSES[config.arch](config)
    model.load_state_dict(weights, strict=True, assign=True)
    for module in model.modules():  # buffers computed at construction (RoPE frequencies, ALiBi slopes)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


class _NoInitialization(TorchFunctionMode):
    """torch.nn.init's functions skipped while a model is built on the meta device, where they
    compute nothing: the first normal_ on a meta tensor runs torch's Python reference kernel,
    which imports torch._dynamo (1.5-3 s of a load's time on 2 cores)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def build(config: ModelConfig | str, **overrides) -> PreTrainedModel:
    """A randomly initialized model from a ModelConfig or a preset name
    (flashformer.model.presets.PRESETS), with any config fields overridden."""
    if isinstance(config, str):
        config = preset(config, **overrides)
    elif isinstance(config, ModelConfig):
        config = config.replace(**overrides) if overrides else config
    else:
        raise TypeError(f"build() takes a ModelConfig or a preset name; got {type(config).__name__}")
    return MODEL_CLASSES[config.arch](config)


def rebuild(model: PreTrainedModel, config: ModelConfig) -> PreTrainedModel:
    """A model of `config` holding `model`'s weights under the names both have (the embeddings
    and blocks, when only the heads differ); a parameter `model` lacks (a new head) is
    initialized as build() does, one `model` has and `config` does not (a dropped head) is left
    out. On `model`'s device and dtype, in its train/eval mode."""
    new = MODEL_CLASSES[config.arch](config)
    load_shared_weights(new, model)
    parameter = next(model.parameters())
    return new.to(parameter.device, parameter.dtype).train(model.training)


def load_shared_weights(model: PreTrainedModel, source: PreTrainedModel) -> list[str]:
    """Copy into `model` every weight of `source` whose name it has; returns the names of
    `model` left as they were. A shared name with another shape is an error."""
    mine = model.state_dict()
    kept = {name: tensor for name, tensor in source.state_dict().items() if name in mine}
    for name, tensor in kept.items():
        if tensor.shape != mine[name].shape:
            raise ValueError(
                f"cannot keep {name}: the source has shape {tuple(tensor.shape)}, the model "
                f"{tuple(mine[name].shape)}"
            )
    model.load_state_dict(kept, strict=False)
    return sorted(set(mine) - set(kept))


def add_task_head(
    encoder: EncoderModel,
    task: str,
    num_labels: int | None = None,
    labels: list[str] | None = None,
    problem_type: str | None = None,
    classifier_pooling: str = "pooler",
    classifier_dropout: float | None = None,
) -> EncoderModel:
    """A pretrained encoder with a new task head (ModelConfig.task: "sequence-classification" or
    "token-classification"), as transformers' BertFor*Classification.from_pretrained gives it: the
    embeddings, blocks and (where the head reads it) pooler kept; the classifier, and a pooler the
    encoder lacked, initialized as transformers initializes what a checkpoint does not hold
    (weights N(0, init_std), biases 0); the masked-LM head dropped."""
    check_arch(encoder.config, "encoder")
    config = encoder.config.replace(
        task=task,
        num_labels=num_labels,
        labels=labels,
        problem_type=problem_type,
        classifier_pooling=classifier_pooling,
        classifier_dropout=classifier_dropout,
    )
    return rebuild(encoder, config)
