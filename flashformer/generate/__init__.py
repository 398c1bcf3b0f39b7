"""Generation: the static KV cache (cache.py), from logits to the next token (sampling.py: the
settings, every logits processor, the choice of a token; the server samples through it too),
decoding sessions and the compiled decode step (session.py), beam search (beam_search.py),
generate() and stream() (mixin.py), and a conversation that keeps its cache (chat.py)."""

from flashformer.generate.chat import Chat
from flashformer.generate.mixin import GenerateOutput, GenerationMixin
from flashformer.generate.sampling import GenerationSettings

__all__ = ["Chat", "GenerateOutput", "GenerationMixin", "GenerationSettings"]
