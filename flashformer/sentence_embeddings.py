"""Re-export (the old path): SentenceEncoder and its helpers live in
flashformer.encoders.sentence_embeddings."""

from flashformer.encoders.sentence_embeddings import (
    Pooling,
    SentenceEncoder,
    read_pooling,
    write_sentence_transformers,
)

__all__ = ["Pooling", "SentenceEncoder", "read_pooling", "write_sentence_transformers"]
