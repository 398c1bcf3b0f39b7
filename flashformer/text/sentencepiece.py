"""SentencePiece-style BPE without a merges table: the backend of a GGUF file's "llama" tokenizer.

    backend = SentencePieceBPE(tokens, scores, add_space_prefix=False, reference=build)
    backend.encode("Hello world").ids         # what `tokenizers`' BPE gives for the same file
    backend.decode(ids, skip_special_tokens=True)

Why not `tokenizers`: a SentencePiece vocabulary names no merges, only a score per token, so the
`tokenizers` BPE model needs every split of every token into two tokens as an explicit merge.
For Gemma 3's 262,144 tokens those are 514,847 merges; with the vocabulary's two Rust hash maps
they hold about 80 MB and take 3 s to derive and build, a third of the model's own weights and
most of its load time. The merges are a function of the vocabulary, so this backend asks the
question at the moment it arises: two adjacent pieces merge when their concatenation is a token,
and of the candidate merges the one `tokenizers` would rank first goes first. The rank of a
derived merge is (joined token's score, longer left part, longer right part, lower id), best
first, as checkpoints.gguf.tokenizer derives them, and the same key orders them here; equal
keys (the same pair twice) go left to right, as in `tokenizers`' merge loop.

It answers the part of the `tokenizers.Tokenizer` interface that text.tokenizer.Tokenizer, the
vocabulary and the GGUF writer call. Decoding runs `tokenizers`' own decoder chain on the
pieces, so the two agree by construction; `to_str()` (saving a tokenizer.json) builds the full
`tokenizers` tokenizer from `reference`, the slow exact path kept for what needs one.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import AddedToken, decoders

SPACE = "▁"


@dataclass(frozen=True)
class Encoding:
    """What `tokenizers`' Encoding gives that callers read: the ids."""

    ids: list[int]


class SentencePieceBPE:
    """tokens: the pieces by id ("▁" for the space, <0xNN> for byte fallback); scores: one per
    token (higher merges first), or merges: "left right" strings in rank order where a file
    gives them. bos/eos: ids the post-processor adds (None: not added). reference: builds the
    equivalent `tokenizers.Tokenizer` when one is needed (to_str)."""

    kind = "bpe"

    def __init__(
        self,
        tokens: list[str],
        scores: list[float] | None = None,
        merges: list[str] | None = None,
        add_space_prefix: bool = True,
        bos: int | None = None,
        eos: int | None = None,
        reference: Callable[[], object] | None = None,
    ):
        if scores is None and merges is None:
            raise ValueError("SentencePieceBPE needs scores (one per token) or merges")
        if scores is not None and len(scores) != len(tokens):
            raise ValueError(f"scores has {len(scores)} entries for {len(tokens)} tokens")
        self._tokens = tokens  # id -> piece (the caller's list, not copied)
        self._extra: list[str] = []  # pieces added beyond the vocabulary (add_tokens of a new text)
        self._vocab = dict(zip(tokens, range(len(tokens))))
        self._scores = scores if scores is None or isinstance(scores, array) else array("d", scores)
        self._ranks = {merge: rank for rank, merge in enumerate(merges)} if merges is not None else None
        self._bytes = [self._vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self.add_space_prefix = add_space_prefix
        self.bos, self.eos = bos, eos
        self._reference = reference
        self._added: dict[str, tuple[int, bool]] = {}  # text -> (id, special), matched whole
        self._added_by_first: dict[str, list[int]] = {}  # first char -> lengths, longest first
        self._special: frozenset[int] = frozenset()  # the ids decode skips
        self._rank_key = self._file_rank if merges is not None else self._score_rank
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1))
        self.decoder = decoders.Sequence(steps)

    # ---- the vocabulary ----

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._tokens) + (len(self._extra) if with_added_tokens else 0)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        vocab = dict(self._vocab)
        if with_added_tokens:
            vocab.update({text: index for text, (index, _) in self._added.items()})
        return vocab

    def token_to_id(self, token: str) -> int | None:
        found = self._added.get(token)
        return found[0] if found is not None else self._vocab.get(token)

    def id_to_token(self, index: int) -> str | None:
        if 0 <= index < len(self._tokens):
            return self._tokens[index]
        if 0 <= index - len(self._tokens) < len(self._extra):
            return self._extra[index - len(self._tokens)]
        return None

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return {
            index: AddedToken(text, special=special, normalized=False)
            for text, (index, special) in sorted(self._added.items(), key=lambda item: item[1][0])
        }

    def add_special_tokens(self, tokens: list[AddedToken]) -> int:
        return self._add(tokens, special=True)

    def add_tokens(self, tokens: list[AddedToken]) -> int:
        return self._add(tokens, special=False)

    def _add(self, tokens: list[AddedToken], special: bool) -> int:
        """Texts matched whole before the merges run (special ones skipped in decode), in the
        vocabulary or appended to it, as `tokenizers` does."""
        new = 0
        for token in tokens:
            text = token.content if isinstance(token, AddedToken) else token
            if not text:
                raise ValueError("an added token's text is empty")
            index = self.token_to_id(text)
            if index is None:
                index = len(self._tokens) + len(self._extra)
                self._extra.append(text)
                new += 1
            was = self._added.get(text)
            self._added[text] = (index, special or (was is not None and was[1]))
        by_first: dict[str, set[int]] = {}
        for text in self._added:
            by_first.setdefault(text[0], set()).add(len(text))
        self._added_by_first = {first: sorted(lengths, reverse=True) for first, lengths in by_first.items()}
        self._special = frozenset(index for index, is_special in self._added.values() if is_special)
        return new

    # ---- encoding ----

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        ids: list[int] = []
        for start, piece, added in self._segments(text):
            if added is not None:
                ids.append(added)
                continue
            piece = piece.replace(" ", SPACE)
            if self.add_space_prefix and start == 0 and not piece.startswith(SPACE):
                piece = SPACE + piece
            ids += self._merge(piece)
        return Encoding(self._post_process(ids) if add_special_tokens else ids)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        return [self.encode(text, add_special_tokens) for text in texts]

    def num_special_tokens_to_add(self, is_pair: bool = False) -> int:
        single = (self.bos is not None) + (self.eos is not None)
        return 2 * single if is_pair else single

    def post_process(self, encoding: Encoding) -> Encoding:
        return Encoding(self._post_process(encoding.ids))

    def _post_process(self, ids: list[int]) -> list[int]:
        return (
            ([self.bos] if self.bos is not None else []) + ids + ([self.eos] if self.eos is not None else [])
        )

    def _segments(self, text: str):
        """(start, text, None) for the runs between added tokens and (start, text, id) for each
        added token, leftmost first and the longest at a place, as `tokenizers` splits them."""
        by_first, added = self._added_by_first, self._added
        start = position = 0
        while position < len(text):
            lengths = by_first.get(text[position])
            match = None
            if lengths is not None:
                match = next(
                    (n for n in lengths if text[position : position + n] in added),
                    None,
                )
            if match is None:
                position += 1
                continue
            if position > start:
                yield start, text[start:position], None
            yield position, text[position : position + match], added[text[position : position + match]][0]
            position += match
            start = position
        if start < len(text):
            yield start, text[start:], None

    def _merge(self, text: str) -> list[int]:
        """The BPE merges of one run: characters (or their UTF-8 bytes as <0xNN> tokens) joined
        pairwise, the best-ranked candidate first, until no adjacent pair forms a token."""
        vocab = self._vocab
        pieces: list[str] = []
        for char in text:
            if char in vocab:
                pieces.append(char)
                continue
            fallback = [self._bytes[b] for b in char.encode("utf-8")]
            if any(index is None for index in fallback):
                raise ValueError(
                    f"the character {char!r} is not in the vocabulary and it has no <0xNN> byte tokens"
                )
            pieces += [self._tokens[index] for index in fallback]
        count = len(pieces)
        following = list(range(1, count + 1))  # following[i] == count: i is the last symbol
        preceding = list(range(-1, count - 1))
        rank = self._rank_key  # chosen once: scores or the file's merges
        queue = [key for i in range(count - 1) if (key := rank(pieces[i], pieces[i + 1], i)) is not None]
        heapq.heapify(queue)
        pop, push = heapq.heappop, heapq.heappush
        while queue:
            *_, i, joined = pop(queue)
            if pieces[i] is None or (j := following[i]) == count or pieces[i] + pieces[j] != joined:
                continue  # stale: one side has merged since
            pieces[i], pieces[j] = joined, None
            after = following[i] = following[j]
            if after < count:
                preceding[after] = i
                if (key := rank(joined, pieces[after], i)) is not None:
                    push(queue, key)
            before = preceding[i]
            if before >= 0 and (key := rank(pieces[before], joined, before)) is not None:
                push(queue, key)
        return [vocab[piece] for piece in pieces if piece is not None]

    def _score_rank(self, left: str, right: str, i: int) -> tuple | None:
        """The queue entry of merging symbol i (left) with the next (right), None when their
        join is not a token: higher score, longer left part, longer right part, lower id, then
        leftmost."""
        joined = left + right
        index = self._vocab.get(joined)
        if index is None:
            return None
        return (-self._scores[index], -len(left), -len(right), index, i, joined)

    def _file_rank(self, left: str, right: str, i: int) -> tuple | None:
        """The same from a file's merges: its rank, then leftmost."""
        joined = left + right
        if joined not in self._vocab:
            return None
        rank = self._ranks.get(f"{left} {right}")
        return None if rank is None else (rank, i, joined)

    # ---- decoding ----

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        special = self._special
        pieces = [
            piece
            for index in ids
            if not (skip_special_tokens and index in special)
            and (piece := self.id_to_token(index)) is not None
        ]
        return self.decoder.decode(pieces)

    # ---- the full `tokenizers` form ----

    def to_str(self) -> str:
        """tokenizer.json of the same tokenizer (its merges derived: seconds for a large vocabulary)."""
        if self._reference is None:
            raise ValueError("this SentencePieceBPE was built without a reference `tokenizers` builder")
        backend = self._reference()
        added = self.get_added_tokens_decoder().values()
        backend.add_special_tokens([t for t in added if t.special])
        backend.add_tokens([t for t in added if not t.special])
        return backend.to_str()
