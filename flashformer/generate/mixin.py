"""Generation over a static KV cache: greedy, sampling, beam search, streaming.

    ids = model.generate(input_ids, max_new_tokens=50)                                  # greedy
    ids = model.generate(input_ids, do_sample=True, temperature=0.8, top_p=0.9, seed=0)  # sampling
    ids = model.generate(input_ids, num_beams=4, length_penalty=1.0, early_stopping=True)
    for tokens in model.stream(input_ids, max_new_tokens=50):                           # (B,) per step
        ...

Arguments have transformers' names and meanings, and generate returns what
transformers' generate returns: for a decoder, the prompt followed by the new
tokens (B, P + n); for an encoder-decoder, the decoder's tokens starting with
decoder_start_token_id (B, 1 + n). Rows that finish early (eos) are filled
with pad_token_id. A batch of prompts of different lengths is left-padded,
with an attention_mask; each row then generates what it would alone, as the
position ids count its real tokens only.

A run is a decoding session (decoding.py: one prefill, then one step per
token against the KV cache) whose logits the settings of sampling.py turn
into the next tokens; beam search (beam_search.py) keeps several
hypotheses per prompt. Every argument is checked before any compute; errors
name the argument.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from flashformer.checks import check_token_ids, padding_mask_from
from flashformer.generate import sampling_options, speculative
from flashformer.generate.beam_search import beam_search
from flashformer.generate.proposers import check_speculation, drafting
from flashformer.generate.sampling import (
    GenerationSettings,
    TokenChooser,
    TokenHistory,
    choose_tokens,
    make_generator,
    settings_from,
)
from flashformer.generate.session import make_session


@dataclass
class GenerateOutput:
    """generate(..., return_dict_in_generate=True): the sequences, and with
    output_logits=True the raw logits of every step, each (B * num_beams, vocab) float32."""

    sequences: Tensor
    logits: tuple[Tensor, ...] | None = None


def check_prompt(model, input_ids, attention_mask, s: GenerationSettings) -> None:
    """The prompt's shape, ids, mask and length, against the model and the settings."""
    config = model.config
    check_token_ids("input_ids", input_ids, config.vocab_size)
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must hold at least one prompt; got shape {tuple(input_ids.shape)}")
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise ValueError(f"input_ids must be on the model's device {device}; got {input_ids.device}")
    real = padding_mask_from("attention_mask", attention_mask, tuple(input_ids.shape))
    if real is not None:
        if real.device != device:
            raise ValueError(f"attention_mask must be on the model's device {device}; got {real.device}")
        empty = (~real.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"attention_mask marks row {empty[0]} of input_ids as all padding: an empty prompt"
            )
        if config.arch == "decoder":
            # new tokens follow the last column, so a decoder's prompts must end there: left padding
            after_real = real.long().cummax(dim=1).values.bool() & ~real
            rows = after_real.any(dim=1).nonzero().flatten().tolist()
            if rows:
                raise ValueError(
                    f"a decoder's prompts must be left-padded (padding before the tokens); attention_mask "
                    f"row {rows[0]} has padding after a real token"
                )
    if drafting(s) and (input_ids.shape[0] != 1 or (real is not None and not bool(real.all()))):
        raise ValueError(
            f"speculative decoding (prompt_lookup_num_tokens, assistant_model) runs one unpadded prompt at a "
            f"time, as transformers' assisted generation; got input_ids of shape {tuple(input_ids.shape)}"
        )
    length = input_ids.shape[1]
    if config.arch == "decoder" and config.position == "learned":
        if length + s.max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"the prompt ({length} tokens) plus max_new_tokens={s.max_new_tokens} is "
                f"{length + s.max_new_tokens} tokens, beyond the model's {config.max_seq_len} learned positions "
                f"(max_seq_len)"
            )
    if config.arch == "encoder-decoder" and config.position == "learned":
        if length > config.max_seq_len or 1 + s.max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"the encoder's prompt ({length} tokens) and the decoder's 1 + max_new_tokens={s.max_new_tokens} "
                f"tokens must each fit the model's {config.max_seq_len} learned positions (max_seq_len)"
            )


# ---- greedy and sampling ----


@torch.no_grad()  # on the generator: each step runs without autograd, the caller's mode untouched
def stream_tokens(
    session, s: GenerationSettings, history: TokenHistory | None, generator, logits_out: list | None = None
) -> Iterator[Tensor]:
    """Yield the next token of every row (B,) per step, until max_new_tokens
    or every row has produced an eos (finished rows then get pad_token_id).
    Inference only, whoever calls it (generate, stream, a chat session): a
    compiled step traced with gradients on would also build a backward graph,
    which a quantized model's layers refuse. With prompt_lookup_num_tokens, an
    assistant_model or a speculative_method the tokens come from speculative decoding (speculative.py):
    the same tokens for greedy, the same distribution when sampling."""
    if drafting(s):
        yield from speculative.speculative_tokens(session, s, history, generator, logits_out)
        return
    chooser = TokenChooser(s, session.input_ids.shape[0], session.input_ids.device, history)
    tokens = None
    for index in range(s.max_new_tokens):
        logits = session.prefill() if index == 0 else session.step(tokens)  # (B, V) float32
        if logits_out is not None:
            logits_out.append(logits)
        scores = chooser.scores(logits, index)
        tokens = chooser.commit(choose_tokens(scores, s.do_sample, generator), index)  # (B,)
        yield tokens
        if chooser.all_ended:
            return


# ---- the methods models get ----


def _prepare(model, input_ids, attention_mask, generator, seed, kwargs):
    s = settings_from(model, **kwargs)
    check_speculation(s, model)
    check_prompt(model, input_ids, attention_mask, s)
    generator = make_generator(generator, seed, input_ids.device)
    return s, generator


def _decoder_prompt(model, input_ids, attention_mask, s):
    """The tokens the decoder starts from (B, P), and which are real (None: all)."""
    if model.config.arch == "encoder-decoder":
        start = torch.full((input_ids.shape[0], 1), s.decoder_start_token_id, device=input_ids.device)
        return start, None
    return input_ids, attention_mask


class GenerationMixin:
    """generate() and stream() for DecoderModel and EncoderDecoderModel."""

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        return_dict_in_generate: bool = False,
        output_logits: bool = False,
        **kwargs,
    ) -> Tensor | GenerateOutput:
        """Generate up to max_new_tokens after each prompt; see the module docstring.

        input_ids: (B, P) prompts, left-padded for a decoder; attention_mask (B, P), 1 = real token.
        Keyword arguments (transformers' names): max_new_tokens=20, min_new_tokens=0,
        do_sample=False, num_beams=1, length_penalty=1.0, early_stopping=False,
        eos_token_id (int or list, the stop tokens; default the config's), pad_token_id,
        decoder_start_token_id; OpenAI's logit_bias ({token id: bias}) and ignore_eos=False
        (vLLM's); flashformer's prefill_chunk_size (None = the whole prompt at once), compile
        (torch.compile the decode step) and constraint (generate.constraints: a Constraint, or
        one per prompt, that the new text must follow: a JSON schema, a regex, a choice, a
        grammar); and the sampling options (generate.sampling_options.OPTIONS), listed below.
        generator or seed make sampling reproducible.
        Returns (B, P + n) for a decoder, (B, 1 + n) for an encoder-decoder, or a
        GenerateOutput with return_dict_in_generate=True.

        Sampling options:
        """
        s, generator = _prepare(self, input_ids, attention_mask, generator, seed, kwargs)
        prompt, real = _decoder_prompt(self, input_ids, attention_mask, s)
        logits_out = [] if output_logits else None
        if s.max_new_tokens == 0:
            sequences = prompt
        elif s.num_beams > 1:
            sequences = beam_search(
                make_session(self, input_ids, attention_mask, s), s, prompt, real, generator, logits_out
            )
        else:
            history = TokenHistory.for_settings(s, prompt, real, self.config.vocab_size)
            session = make_session(self, input_ids, attention_mask, s)
            steps = list(stream_tokens(session, s, history, generator, logits_out))
            sequences = torch.cat([prompt] + [t[:, None] for t in steps], dim=1)
        if return_dict_in_generate:
            return GenerateOutput(sequences, tuple(logits_out) if output_logits else None)
        return sequences

    generate.__doc__ = generate.__doc__.rstrip() + "\n" + sampling_options.describe(" " * 12) + "\n"

    def stream(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        **kwargs,
    ) -> Iterator[Tensor]:
        """Like generate() (greedy or sampling), but yields each step's new tokens (B,) as they come."""
        s, generator = _prepare(self, input_ids, attention_mask, generator, seed, kwargs)
        if s.num_beams != 1:
            raise ValueError(
                f"stream() yields one token per step, which beam search cannot (a beam's earlier tokens "
                f"change until it ends); got num_beams={s.num_beams}"
            )
        return self._stream(input_ids, attention_mask, s, generator)

    @torch.no_grad()
    def _stream(self, input_ids, attention_mask, s, generator) -> Iterator[Tensor]:
        prompt, real = _decoder_prompt(self, input_ids, attention_mask, s)
        history = TokenHistory.for_settings(s, prompt, real, self.config.vocab_size)
        session = make_session(self, input_ids, attention_mask, s)
        yield from stream_tokens(session, s, history, generator)
