"""Every GGUF architecture flashformer reads and writes, in one table: the reader
(checkpoint.read_gguf), the writer (writer.write_gguf) and the benchmarks' model shapes all
look an architecture up here.

Each architecture is a module of its own (llama.py, qwen2.py, ...), whose class gives the file's
metadata as transformers' config.json (`config(file)`), the tensor table that config implies
(`tensors(hf)`: GGUF name, transformers name, shape, as common.TensorSpec) and a one-line
`summary(hf)` for errors. Those that can also be written have a writer class beside it: the
config.json values as the architecture's metadata (`metadata(hf)`) and any tensor that is not
among transformers' weights (`extra_tensor(spec, hf)`). Adding an architecture is its module and
a row below (two rows if it can be written).
"""

from __future__ import annotations

from flashformer.checkpoints.gguf.gemma import Gemma
from flashformer.checkpoints.gguf.gemma4 import Gemma4
from flashformer.checkpoints.gguf.gpt2 import GPT2, GPT2Writer
from flashformer.checkpoints.gguf.gpt_oss import GptOss
from flashformer.checkpoints.gguf.lfm2 import Lfm2
from flashformer.checkpoints.gguf.llama import Llama, LlamaWriter
from flashformer.checkpoints.gguf.phi3 import Phi3
from flashformer.checkpoints.gguf.qwen2 import Qwen2, Qwen2Writer
from flashformer.checkpoints.gguf.qwen3 import Qwen3, Qwen3Moe
from flashformer.checkpoints.gguf.smollm3 import SmolLM3, SmolLM3Writer

# the file's general.architecture -> what its metadata and tensors mean
ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Llama(),
        Qwen2(),
        Phi3(),
        GPT2(),
        Qwen3(),
        Qwen3Moe(),
        GptOss(),
        Lfm2(),
        Gemma("gemma", 1),
        Gemma("gemma2", 2),
        Gemma("gemma3", 3),
        SmolLM3(),
        Gemma4(),
    )
}

# config.json's model_type -> how it is written (writer.architecture names its ARCHITECTURES row)
WRITERS = {
    writer.model_type: writer for writer in (LlamaWriter(), Qwen2Writer(), GPT2Writer(), SmolLM3Writer())
}
