"""Constrained decoding: a grammar decides which tokens may come next, so the text always
parses (a JSON schema's instance, a regex's match, one of a few strings, a grammar's sentence).

    constraint = Constraint.json_schema(schema, tokenizer)          # or json_object, regex,
    constraint = Constraint.from_spec({"regex": r"\\d+"}, tokenizer)  # choice, grammar (Lark/GBNF)
    ids = model.generate(input_ids, constraint=constraint, max_new_tokens=200)

    matcher = constraint.matcher()        # one per sequence: where in the grammar it stands
    scores = constrain(scores, [matcher, None, ...], stop_ids)  # (B, V): only the allowed
    matcher.advance(token)                # after the token is chosen
    matcher.accepting, matcher.finished   # may end here (stop tokens allowed) / must end

The grammar engine is llguidance (Microsoft's; a Rust wheel with no Python dependencies): it
compiles a schema in about a millisecond and computes a mask in tens of microseconds on
SmolLM2's 49k vocabulary and Gemma 3's 262k (docs/serving.md, "Structured outputs": the
figures beside xgrammar's, which compiles 25-100x slower). It reads the vocabulary as bytes
per token (text.vocabulary, from flashformer's own tokenizer), described once per tokenizer
and vocabulary size (GrammarVocabulary, cached).

The stop tokens are the caller's (generate()'s eos_token_id, a request's stop tokens): the
engine's own end-of-sequence bits are cleared from its mask and the caller's stop tokens are
allowed exactly where the grammar may end; where it must end, they are all that is allowed.
Compiled constraints are cached by the spec's canonical JSON (compile_constraint), so a
server compiles each distinct schema once.
"""

from __future__ import annotations

import json
import math
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flashformer.text.vocabulary import Vocabulary, vocabulary_of

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# JSON as json.dumps writes it by default ({"a": 1, "b": [2, 3]}): one space after ":" and ",",
# no other whitespace, so a model cannot run away in blank lines inside the object
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


class UnsupportedSchema(ValueError):
    """A JSON schema keyword the grammar engine cannot enforce (keyword: its name)."""

    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "constrained decoding needs the llguidance package: pip install llguidance"
        ) from None
    return llguidance


# ---- the spec: what is asked for ----


@dataclass(frozen=True)
class ConstraintSpec:
    """What a constraint asks for: kind (one of KINDS) and its value (a schema dict, a regex,
    a list of strings, a Lark or GBNF grammar; None for json_object). key: the canonical JSON
    that identifies it (the compile cache's key)."""

    kind: str
    value: object = None

    @property
    def key(self) -> str:
        return json.dumps([self.kind, self.value], sort_keys=True, separators=(",", ":"))

    @staticmethod
    def parse(spec: dict) -> ConstraintSpec:
        """{"json_schema": {...}} | {"json_object": True} | {"regex": "..."} | {"choice": [...]}
        | {"grammar": "..."}: exactly one kind, its value checked."""
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ValueError(f"a constraint spec is a dict with one key of {list(KINDS)}; got {spec!r}")
        kind, value = next(iter(spec.items()))
        return ConstraintSpec.of(kind, value)

    @staticmethod
    def of(kind: str, value=None) -> ConstraintSpec:
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as error:
                    raise ValueError(f"json_schema is not valid JSON: {error}") from None
            if not isinstance(value, dict | bool):
                raise ValueError(f"json_schema must be a JSON object (a schema); got {type(value).__name__}")
        elif kind == "json_object":
            value = None
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{kind} must be a non-empty string; got {value!r}")
        elif kind == "choice":
            if (
                not isinstance(value, list | tuple)
                or not value
                or not all(isinstance(v, str) and v for v in value)
            ):
                raise ValueError(f"choice must be a non-empty list of non-empty strings; got {value!r}")
            value = list(value)
        else:
            raise ValueError(f"a constraint's kind is one of {list(KINDS)}; got {kind!r}")
        return ConstraintSpec(kind, value)

    def grammar(self) -> str:
        """The spec as an llguidance grammar (its JSON form, or Lark)."""
        ll = _llguidance()
        if self.kind == "json_schema":
            return ll.LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":  # Lark's string literals take JSON's escapes
            return ll.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in self.value))
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF (llama.cpp's) becomes Lark

        try:
            lark = any_to_lark(self.value)
        except Exception as error:  # the converter's own error type names the position
            raise ValueError(f"grammar: not a Lark or GBNF grammar: {error}") from None
        return ll.LLMatcher.grammar_from_lark(lark)


# ---- the vocabulary, as the engine reads it ----


class GrammarVocabulary:
    """A tokenizer's vocabulary described for llguidance, once: the bytes of each of the
    model's vocab_size ids (ids past the tokenizer's are never allowed), its special tokens
    and end-of-sequence ids. Building it walks every token (0.2 s for 49k tokens, 2 s for
    262k), so it is cached per tokenizer and size (GrammarVocabulary.of)."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer, vocab_size: int | None = None):
        ll = _llguidance()
        vocab: Vocabulary = vocabulary_of(tokenizer)
        size = vocab_size or len(vocab)
        if size < len(vocab):
            raise ValueError(
                f"vocab_size={size} is smaller than the tokenizer's {len(vocab)} tokens "
                f"(the model's vocabulary must hold every token the tokenizer makes)"
            )
        tokens = list(vocab.tokens) + [b""] * (size - len(vocab))
        special = sorted(vocab.special | set(range(len(vocab), size)))
        self.vocab_size, self.eos = size, tuple(vocab.eos)
        self.words = (size + 31) // 32  # int32 words of a bitmask row

        described = _Described(tokens, special, vocab.eos, tokenizer)
        self.engine = ll.LLTokenizer(
            ll.TokenizerWrapper(described), n_vocab=size, eos_token=list(vocab.eos) or None
        )
        if self.engine.vocab_size != size:
            raise ValueError(f"llguidance made a vocabulary of {self.engine.vocab_size} tokens, not {size}")
        self.engine_eos = torch.tensor(self.engine.eos_tokens, dtype=torch.long)  # its own stop bits

    @classmethod
    def of(cls, tokenizer, vocab_size: int | None = None) -> GrammarVocabulary:
        with cls._lock:
            by_size = cls._cache.setdefault(tokenizer, {})
            if vocab_size not in by_size:
                by_size[vocab_size] = cls(tokenizer, vocab_size)
            return by_size[vocab_size]


class _Described:
    """The interface llguidance.TokenizerWrapper reads: the bytes of every id, the special ids,
    the end-of-sequence id and an encoder (for its prompt-healing helpers)."""

    bos_token_id = None

    def __init__(self, tokens: list[bytes], special: list[int], eos: tuple[int, ...], tokenizer):
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id = eos[0] if eos else 0
        self.tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        text = text if isinstance(text, str) else text.decode("utf-8", errors="replace")
        if getattr(self.tokenizer, "kind", None) == "byte":  # text.bpe.ByteTokenizer adds nothing
            return self.tokenizer.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False)


# ---- a compiled constraint, and one sequence's matcher ----


class Constraint:
    """A spec compiled over one vocabulary. matcher() gives each sequence its own state; the
    compiled grammar is shared. Build one with the class methods or compile_constraint."""

    def __init__(self, spec: ConstraintSpec, vocabulary: GrammarVocabulary):
        ll = _llguidance()
        self.spec, self.vocabulary = spec, vocabulary
        grammar = spec.grammar()
        start = ll.LLMatcher(vocabulary.engine, grammar, log_level=0)
        if start.is_error():
            raise _compile_error(spec, start.get_error())
        self._start = Matcher(start, vocabulary)
        self._start.fill(torch.empty(vocabulary.words, dtype=torch.int32))  # the first mask, now
        if self._start.matcher.is_error():
            raise _compile_error(spec, self._start.matcher.get_error())

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (a copy of the compiled one's)."""
        return self._start.copy()

    def __repr__(self) -> str:
        text = self.spec.key
        return f"Constraint({text[:77] + '...' if len(text) > 80 else text})"

    # ---- construction ----

    @classmethod
    def json_schema(cls, schema: dict | str, tokenizer, vocab_size: int | None = None) -> Constraint:
        return compile_constraint(ConstraintSpec.of("json_schema", schema), tokenizer, vocab_size)

    @classmethod
    def json_object(cls, tokenizer, vocab_size: int | None = None) -> Constraint:
        return compile_constraint(ConstraintSpec.of("json_object"), tokenizer, vocab_size)

    @classmethod
    def regex(cls, pattern: str, tokenizer, vocab_size: int | None = None) -> Constraint:
        return compile_constraint(ConstraintSpec.of("regex", pattern), tokenizer, vocab_size)

    @classmethod
    def choice(cls, options: list[str], tokenizer, vocab_size: int | None = None) -> Constraint:
        return compile_constraint(ConstraintSpec.of("choice", options), tokenizer, vocab_size)

    @classmethod
    def grammar(cls, grammar: str, tokenizer, vocab_size: int | None = None) -> Constraint:
        """A Lark grammar (llguidance's dialect: `start: ...`, `%json {...}` for a schema
        inside) or a GBNF one (llama.cpp's `root ::= ...`)."""
        return compile_constraint(ConstraintSpec.of("grammar", grammar), tokenizer, vocab_size)

    @classmethod
    def from_spec(cls, spec: dict | ConstraintSpec, tokenizer, vocab_size: int | None = None) -> Constraint:
        spec = spec if isinstance(spec, ConstraintSpec) else ConstraintSpec.parse(spec)
        return compile_constraint(spec, tokenizer, vocab_size)


def _compile_error(spec: ConstraintSpec, message: str) -> ValueError:
    """The engine's error as ValueError; a schema keyword it does not implement as
    UnsupportedSchema naming the keyword."""
    unimplemented = UNIMPLEMENTED.search(message)
    if unimplemented:
        keyword = unimplemented.group(1).split(",")[0].strip().strip('"')
        return UnsupportedSchema(
            keyword, f"the JSON schema keyword {keyword!r} cannot be enforced by the grammar engine"
        )
    return ValueError(f"{spec.kind}: the grammar does not compile: {message}")


class Matcher:
    """One sequence's place in a constraint's grammar (llguidance's LLMatcher)."""

    def __init__(self, matcher, vocabulary: GrammarVocabulary):
        self.matcher, self.vocabulary = matcher, vocabulary

    def copy(self) -> Matcher:
        return Matcher(self.matcher.deep_copy(), self.vocabulary)

    def fill(self, row: Tensor) -> None:
        """The allowed tokens as a bitmask into row (words,) int32, contiguous on the CPU: bit i
        of word w is token 32 w + i (the engine's own stop bits set where the grammar may end)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def fill_array(self, row: np.ndarray) -> None:
        """fill() into a numpy row (words,) int32."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)

    def advance(self, token: int) -> bool:
        """Take the chosen token; False if the grammar did not allow it (the matcher then stays
        in an error state and finished is True)."""
        if self.matcher.is_error():
            return False
        if self.finished and int(token) in self.vocabulary.eos:
            return True
        return self.matcher.consume_token(int(token))

    @property
    def accepting(self) -> bool:
        """The text so far is a whole sentence of the grammar: the sequence may end here."""
        return self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing may follow but a stop token (the grammar is complete, or the matcher failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


# ---- the compile cache ----

CACHE_SIZE = 256
_compiled: OrderedDict = OrderedDict()
_compiled_lock = threading.Lock()


def compile_constraint(spec: ConstraintSpec, tokenizer, vocab_size: int | None = None) -> Constraint:
    """The spec compiled over the tokenizer's vocabulary, from an LRU cache of CACHE_SIZE
    keyed by the spec's canonical JSON (and the vocabulary): a schema is compiled once, however
    many requests ask for it. Thread-safe; a server calls it off the engine's thread."""
    vocabulary = GrammarVocabulary.of(tokenizer, vocab_size)
    key = (spec.key, id(vocabulary))
    with _compiled_lock:
        if key in _compiled:
            _compiled.move_to_end(key)
            return _compiled[key]
    constraint = Constraint(spec, vocabulary)
    with _compiled_lock:
        _compiled[key] = constraint
        while len(_compiled) > CACHE_SIZE:
            _compiled.popitem(last=False)
    return constraint


# ---- masks on scores ----


def allowed_tokens(matchers: list[Matcher], stop_ids: Tensor, vocab_size: int) -> Tensor:
    """(N, vocab_size) bool: the tokens each matcher allows next (ids past the constraint's
    vocabulary never). The engine's own stop bits are replaced by stop_ids (the caller's stop
    tokens): allowed where the grammar may end and, where it must end, the only ones allowed."""
    vocabulary = matchers[0].vocabulary
    bitmask = np.empty((len(matchers), vocabulary.words), dtype=np.int32)  # (N, W)
    for row, matcher in zip(bitmask, matchers):
        matcher.fill_array(row)
    bits = np.unpackbits(
        bitmask.view(np.uint8), axis=1, bitorder="little"
    )  # (N, 32W): words are little-endian
    known = min(vocab_size, vocabulary.vocab_size)
    if known == vocab_size:
        allowed = torch.from_numpy(bits[:, :vocab_size].view(np.bool_))  # (N, V), no copy
    else:  # ids past the constraint's vocabulary are never allowed
        allowed = torch.zeros(len(matchers), vocab_size, dtype=torch.bool)
        allowed[:, :known] = torch.from_numpy(bits[:, :known].view(np.bool_))
    allowed[:, vocabulary.engine_eos[vocabulary.engine_eos < vocab_size]] = False
    stop_ids = stop_ids[stop_ids < vocab_size]
    if len(stop_ids):
        ending = torch.tensor([m.accepting or m.finished for m in matchers])  # (N,)
        allowed[:, stop_ids] = ending[:, None]
    return allowed


def constrain(scores: Tensor, matchers: list[Matcher | None], stop_ids: Tensor) -> Tensor:
    """scores (B, V) with -inf wherever a row's matcher forbids the token; rows without a matcher
    (None) are left as they are and cost nothing. stop_ids: the caller's stop tokens (when
    empty, the tokenizer's end-of-sequence ids, so that a finished grammar can still end)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return scores
    constrained = [matchers[i] for i in rows]
    if not len(stop_ids):
        stop_ids = torch.tensor(constrained[0].vocabulary.eos, dtype=torch.long)
    allowed = allowed_tokens(constrained, stop_ids.cpu(), scores.shape[-1]).to(scores.device)  # (N, V)
    forbidden = torch.tensor(-math.inf, dtype=scores.dtype, device=scores.device)
    if len(rows) == scores.shape[0]:
        return torch.where(allowed, scores, forbidden)
    index = torch.tensor(rows, device=scores.device)
    return scores.index_copy(0, index, torch.where(allowed, scores[index], forbidden))


def keep_an_end(processed: Tensor, masked: Tensor) -> Tensor:
    """processed (B, V), the logits processors' output over masked scores, except in rows where
    they left no token (min_new_tokens forbidding the stop tokens a finished grammar allows
    alone): there the grammar wins, and the masked scores stand. Only min_new_tokens can empty
    a row (the filters keep at least one token), so callers ask only before it is reached."""
    dead = torch.isneginf(processed).all(dim=-1, keepdim=True)  # (B, 1)
    return torch.where(dead, masked, processed)


# ---- a batch's matchers ----


def matchers_for(constraint, batch: int) -> list[Matcher | None] | None:
    """One matcher per row for generate(constraint=...): a Constraint applies to every row, a
    list gives each row its own (None: that row is free); None when nothing is constrained."""
    if constraint is None:
        return None
    if isinstance(constraint, Constraint):
        return [constraint.matcher() for _ in range(batch)]
    if len(constraint) != batch:
        raise ValueError(
            f"constraint: a list needs one Constraint (or None) per prompt, {batch}; got {len(constraint)}"
        )
    return [None if c is None else c.matcher() for c in constraint]


def check_constraint(constraint) -> None:
    """generate()'s constraint: None, a Constraint, or a list of Constraint | None."""
    if constraint is None or isinstance(constraint, Constraint):
        return
    if isinstance(constraint, list | tuple) and all(
        c is None or isinstance(c, Constraint) for c in constraint
    ):
        return
    raise ValueError(
        "constraint must be a Constraint (generate.constraints: Constraint.json_schema(schema, tokenizer), "
        f"...), or a list of them (None for a free row); got {type(constraint).__name__}"
    )
