"""Sentence embeddings behind the server's loop (POST /v1/embeddings on an encoder model).

Each step takes up to `max_batch` waiting inputs in arrival order (whatever
requests they belong to), sorts them by length, pads them into one batch and
pools the encoder's hidden states as the model's sentence-transformers files
say (sentence_embeddings.Pooling). A request is answered when its last input
is done; one whose client went away is dropped before its inputs run. Texts
are cut to the encoder's max_length tokens, as sentence-transformers' encode
cuts them, so a vector equals `SentenceEncoder.encode`'s for the same text.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from flashformer.encoders.sentence_embeddings import SentenceEncoder, embed
from flashformer.serve.loop import ModelLoop
from flashformer.text.encoder_inputs import encode_texts, pad_batch, pad_id_of


class EmbeddingRequest:
    """Inputs as token ids and where the answer goes: emit(vectors, None) with one float32
    vector per input, or emit(None, message) when the engine failed."""

    def __init__(self, inputs: list[list[int]], emit: Callable[[list[np.ndarray] | None, str | None], None]):
        self.inputs, self.emit = [list(ids) for ids in inputs], emit
        self.vectors: list[np.ndarray | None] = [None] * len(self.inputs)
        self.remaining = len(self.inputs)
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


class EmbeddingEngine(ModelLoop):
    """A SentenceEncoder and its loop. max_batch: inputs encoded together in one step;
    max_waiting: inputs that may wait before submit() raises Busy."""

    def __init__(self, encoder: SentenceEncoder, *, max_batch: int = 32, max_waiting: int = 1024):
        super().__init__(max_waiting)
        self.encoder, self.tokenizer, self.model = encoder, encoder.tokenizer, encoder.model
        self.max_batch, self.max_length, self.dimension = max_batch, encoder.max_length, encoder.dimension
        self.pad_id = pad_id_of(self.tokenizer)
        self.device = next(self.model.parameters()).device
        self.waiting: deque[tuple[EmbeddingRequest, int]] = deque()  # (request, input index)
        self.stats = {"steps": 0, "embedded_inputs": 0, "prompt_tokens": 0}

    def encode(self, texts: list[str]) -> list[list[int]]:
        """The texts' ids as the encoder reads them: special tokens added, cut to max_length."""
        return encode_texts(self.tokenizer, texts, self.max_length)

    def submit(self, request: EmbeddingRequest) -> None:
        """Queue a request (thread-safe). Raises Busy past max_waiting, ValueError for an empty
        input or one of more than max_length token ids."""
        if not request.inputs:
            raise ValueError("input: give at least one text")
        vocab = self.model.config.vocab_size
        for index, ids in enumerate(request.inputs):
            if not ids:
                raise ValueError(f"input[{index}] is empty")
            if len(ids) > self.max_length:
                raise ValueError(
                    f"input[{index}] is {len(ids)} tokens; this model reads at most {self.max_length}"
                )
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"input[{index}]: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self._enqueue(request, len(request.inputs))

    def metrics(self) -> dict:
        return {
            "inputs_waiting": self._waiting_count,
            "inputs_per_second": self._rate(),
            **self.stats,
        }

    # ---- the loop ----

    def _accept(self, request: EmbeddingRequest) -> None:
        self.waiting.extend((request, index) for index in range(len(request.inputs)))

    def _has_work(self) -> bool:
        return bool(self.waiting)

    def _fail_all(self, message: str) -> None:
        for request in {id(r): r for r, _ in self.waiting}.values():
            request.emit(None, message)
        self.waiting = deque()

    @torch.no_grad()
    def step(self) -> None:
        """Encode the next max_batch waiting inputs together."""
        taken = []
        while self.waiting and len(taken) < self.max_batch:
            request, index = self.waiting.popleft()
            self._count_waiting(-1)
            if not request.cancelled.is_set():
                taken.append((request, index))
        if not taken:
            return
        taken.sort(key=lambda item: -len(item[0].inputs[item[1]]))  # stable: arrival order within a length
        batch = pad_batch([request.inputs[index] for request, index in taken], self.pad_id)
        batch = {name: tensor.to(self.device) for name, tensor in batch.items()}
        vectors = embed(self.model, batch, self.encoder.pooling).float().cpu().numpy()  # (B, dimension)
        for (request, index), vector in zip(taken, vectors):
            request.vectors[index] = vector
            request.remaining -= 1
            if request.remaining == 0:
                request.emit(request.vectors, None)
        tokens = int(batch["attention_mask"].sum())
        self.stats["steps"] += 1
        self.stats["embedded_inputs"] += len(taken)
        self.stats["prompt_tokens"] += tokens
        self._note_progress(len(taken))
