"""Tokens <-> text: a real model's tokenizer (tokenizer.py) and its chat templates
(chat_template.py), the byte and BPE tokenizers of flashformer's own runs (bpe.py), an encoder's
inputs from text (encoder_inputs.py), and the one incremental detokenizer (stop strings, partial
UTF-8) that `generate`, `chat` and the server share (detokenizer.py)."""

from flashformer.text.detokenizer import Detokenizer, stream_text
from flashformer.text.tokenizer import Tokenizer

__all__ = ["Detokenizer", "Tokenizer", "stream_text"]
