"""flashformer: the Transformer, exact, IO-aware and measured."""

from flashformer.attention.api import attention

__version__ = "0.1.0"
__all__ = ["attention"]
