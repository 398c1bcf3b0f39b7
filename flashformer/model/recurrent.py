"""The recurrent alternatives to the Transformer: LSTM and GRU language models, and the base
they share with the state-space model (ssm.py).

    model = flashformer.build("lstm-mini")            # or build(ModelConfig(arch="gru", ...))
    out = model(input_ids, labels=input_ids)          # training: the whole sequence in one call
    ids = model.generate(prompt, max_new_tokens=50)   # decoding: a fixed-size state per layer

A layer carries a state from token to token instead of attending to every earlier token.
Training runs PyTorch's fused nn.LSTM / nn.GRU over the sequence (oneDNN on the CPU, cuDNN on a
GPU: sequential in the positions inside the kernel, which is what a Transformer avoids);
generation keeps one RecurrentState per layer (generate/cache.py) whose size does not depend on
the number of tokens seen: O(1) memory per token, where a KV cache grows by one row per token.
The models take DecoderModel's forward arguments, so `flashformer train`'s trainer, objective,
run folders and `generate()` drive them unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.checks import IGNORE_INDEX, check_labels, check_logits_to_keep, padding_mask_from
from flashformer.generate.cache import RecurrentState
from flashformer.generate.mixin import GenerationMixin
from flashformer.kernels.cpu import Linear, linear
from flashformer.model.base import ModelOutput, PreTrainedModel, check_arch, cross_entropy
from flashformer.model.config import ModelConfig


class RecurrentLanguageModel(GenerationMixin, PreTrainedModel):
    """Token embeddings -> n_layers stateful layers -> final norm -> LM head (tied to the token
    table unless tie_word_embeddings=False).

    A family gives its layers (make_layer(config, index): a module with forward(x, state) and
    new_state(batch, device, dtype)) and its final norm. Positions are not read (the recurrence
    orders the tokens), nor padding: every row is read from its first token to its last.
    """

    def __init__(self, config: ModelConfig, arch: str, make_layer, final_norm: nn.Module):
        super().__init__()
        check_arch(config, arch)
        self.config = config
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(make_layer(config, index) for index in range(config.n_layers))
        self.final_norm = final_norm
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.init_weights()

    def init_weights(self) -> None:
        """The token table (and an untied head) N(0, init_std); each layer keeps its own scheme
        (reset_parameters: PyTorch's for the RNNs, Mamba's for the SSM blocks)."""
        nn.init.normal_(self.tokens.weight, std=self.config.init_std)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=self.config.init_std)
        for layer in self.layers:
            layer.reset_parameters()
        for module in self.final_norm.modules():
            if hasattr(module, "weight") and module.weight is not None:
                nn.init.ones_(module.weight)

    def new_states(self, batch: int, device, dtype: torch.dtype | None = None) -> list[RecurrentState]:
        """One empty state per layer (generate's make_caches asks for these in place of KV caches)."""
        dtype = dtype if dtype is not None else self.tokens.weight.dtype
        return [layer.new_state(batch, torch.device(device), dtype) for layer in self.layers]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        kv_caches: list[RecurrentState] | None = None,
        cache_position: int = 0,
        token_type_ids: Tensor | None = None,
        logits_to_keep: int = 0,
        output_attentions: bool = False,
    ) -> ModelOutput:
        """input_ids (B, L): the new tokens; DecoderModel.forward's arguments and outputs.

        kv_caches: one RecurrentState per layer (new_states()), holding cache_position tokens;
        each is advanced by the L new tokens. attention_mask may only mark every token real;
        position_ids are not read.
        """
        self._check_ids("input_ids", input_ids)
        batch, length = input_ids.shape
        real = padding_mask_from("attention_mask", attention_mask, (batch, cache_position + length))
        if real is not None and not bool(real.all()):
            raise ValueError(
                f"a {self.config.arch} model reads every token of a row in order and takes no padding; "
                "attention_mask marks padded tokens: generate each prompt alone"
            )
        if token_type_ids is not None or output_attentions:
            raise ValueError(
                f"a {self.config.arch} model has no token types and no attention to return; got "
                f"token_type_ids={token_type_ids is not None}, output_attentions={output_attentions}"
            )
        check_labels(labels, (batch, length), self.config.vocab_size)
        check_logits_to_keep(logits_to_keep, length, labels)
        self._check_states(kv_caches, cache_position)

        x = self.dropout(self.tokens(input_ids))  # (B, L, d_model)
        for index, layer in enumerate(self.layers):
            x = layer(x, None if kv_caches is None else kv_caches[index])  # (B, L, d_model)
        hidden = self.final_norm(x)
        logits = self.project(hidden[:, -logits_to_keep:])  # (B, L or logits_to_keep, vocab)
        loss = None
        if labels is not None:  # position t predicts label t+1, as DecoderModel
            shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
            loss = cross_entropy(logits, shifted)
        return ModelOutput(last_hidden_state=hidden, logits=logits, loss=loss)

    def _check_states(self, states, cache_position: int) -> None:
        if states is None:
            if cache_position != 0:
                raise ValueError(
                    f"cache_position={cache_position} needs the states (kv_caches) that hold them"
                )
            return
        if len(states) != len(self.layers) or not all(isinstance(s, RecurrentState) for s in states):
            raise ValueError(
                f"kv_caches must hold one RecurrentState per layer ({len(self.layers)}; model.new_states()); "
                f"got {[type(s).__name__ for s in states]}"
            )
        for state in states:
            state.check_position(cache_position)

    def project(self, hidden: Tensor) -> Tensor:
        """hidden (B, L, d_model) -> logits (B, L, vocab)."""
        return linear(hidden, self.output_embedding)

    @property
    def output_embedding(self) -> Tensor:
        return self.tokens.weight if self.lm_head is None else self.lm_head.weight

    def save_pretrained(self, folder) -> None:
        raise ValueError(
            f"a {self.config.arch} model has no Hugging Face family to save as; its run folder's "
            "checkpoints load with flashformer.load"
        )


# ---- LSTM and GRU ----


class RNNLayer(nn.Module):
    """One nn.LSTM / nn.GRU layer of width d_model, then dropout (between layers, as a stacked
    nn.LSTM(num_layers=n) applies it). Its state: the last hidden state h (B, d_model), and
    an LSTM's cell c."""

    state_names: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, rnn: nn.RNNBase):
        super().__init__()
        self.width = config.d_model
        self.rnn = rnn
        self.dropout = nn.Dropout(config.dropout)

    def reset_parameters(self) -> None:
        self.rnn.reset_parameters()  # PyTorch's U(-1/sqrt(d), 1/sqrt(d))

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> RecurrentState:
        return RecurrentState(
            **{name: torch.zeros(batch, self.width, dtype=dtype, device=device) for name in self.state_names}
        )

    def forward(self, x: Tensor, state: RecurrentState | None) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model); the state, if given, is read and advanced."""
        if state is None:
            out, _ = self.rnn(x)  # (B, L, d_model), from a zero state
        else:
            out, last = self.rnn(x, self.hidden(state, x.dtype))
            state.advance(x.shape[1], **self.unpack(last))
        return self.dropout(out)


class LSTMLayer(RNNLayer):
    state_names = ("h", "c")

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__(config, nn.LSTM(config.d_model, config.d_model, batch_first=True))

    def reset_parameters(self) -> None:
        """PyTorch's init, with the forget gate's bias at 1 (Jozefowicz et al. 2015: gradients
        flow through the cell from the start)."""
        super().reset_parameters()
        d = self.width
        with torch.no_grad():  # gate order i, f, g, o
            self.rnn.bias_ih_l0[d : 2 * d].fill_(1.0)
            self.rnn.bias_hh_l0[d : 2 * d].zero_()

    @staticmethod
    def hidden(state: RecurrentState, dtype) -> tuple[Tensor, Tensor]:
        return state["h"][None].to(dtype), state["c"][None].to(dtype)  # (1, B, d) each

    @staticmethod
    def unpack(last: tuple[Tensor, Tensor]) -> dict:
        return {"h": last[0][0], "c": last[1][0]}


class GRULayer(RNNLayer):
    state_names = ("h",)

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__(config, nn.GRU(config.d_model, config.d_model, batch_first=True))

    @staticmethod
    def hidden(state: RecurrentState, dtype) -> Tensor:
        return state["h"][None].to(dtype)  # (1, B, d)

    @staticmethod
    def unpack(last: Tensor) -> dict:
        return {"h": last[0]}


class LSTMModel(RecurrentLanguageModel):
    """An LSTM language model (arch "lstm"): n_layers LSTM layers of width d_model."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, "lstm", LSTMLayer, nn.Identity())


class GRUModel(RecurrentLanguageModel):
    """A GRU language model (arch "gru"): n_layers GRU layers of width d_model."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, "gru", GRULayer, nn.Identity())
