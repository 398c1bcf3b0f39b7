"""SmolLM3 and Phi-4-mini (LongRoPE) on files of llama.cpp's own tools, as docs/models.md reports
them: tiny random models of transformers' own classes, saved beside SmolLM2's tokenizer,
converted by llama.cpp's convert_hf_to_gguf.py to F32 and quantized by llama-quantize to Q8_0 and
Q4_K_M (the recipe of CONVERTING.md); then

- float: flashformer's logits of the folder and of the F32 file against transformers' (the
  largest difference over the largest logit), and greedy tokens with the cache (Phi-4-mini past
  its original context, where the long factors take over);
- quantized: flashformer's logits on each quantized file and llama.cpp's own on it, each against
  the float model (transformers on the folder): the largest difference over the largest logit
  and the mean KL divergence from the float model's distribution.

    python scripts/new_dense_check.py --llama-cpp-src SRC [--out DIR]

SRC is a llama.cpp tree with its gguf-py and a build (build-native/bin: llama-quantize,
libllama.so) and llama-cpp-python's package beside it (SRC/../../llama_cpp, as its source
distribution vendors the tree), run in a process of its own. The converter needs sentencepiece
(`pip install --target DIR sentencepiece diskcache`, given with --extra-path DIR).

llama.cpp pads its context to a multiple of 256 and picks LongRoPE's long factors for every
position when that context passes the original one: the quantized Phi-4-mini is compared at 200
positions in a context of 256 (original 256: short factors in both) and at 300 in one of 512
(long factors for all 300 in both: one forward pass past the original context).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import flashformer
from flashformer.checkpoints.gguf.packaged_models import smollm2_path

EVALUATE = """
import sys, numpy as np, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[4]), logits_all=True, verbose=False, n_threads=2)
ids = [int(i) for i in sys.argv[3].split(",")]
llm.eval(ids)
np.save(sys.argv[2], np.array(llm.scores[: len(ids)], dtype=np.float32))
"""
# the converter's hash table does not know a re-saved tokenizer: name SmolLM2's pre-tokenizer
CONVERT = """
import runpy, sys
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def save_tokenizer(folder: Path, gpt2_class: bool) -> int:
    """SmolLM2's tokenizer into `folder`; Phi-4-mini's converter reads the GPT-2 vocabulary only
    when tokenizer_class says GPT2Tokenizer."""
    from transformers import AutoTokenizer

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(folder)
    if gpt2_class:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"})
        )
    return len(tokenizer)


def nudged(model):
    """Norm weights away from 1, so that a misplaced norm shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model.eval()


def make_smollm3(folder: Path) -> None:
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    vocab = save_tokenizer(folder, gpt2_class=False)
    torch.manual_seed(0)
    config = SmolLM3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=2, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    nudged(SmolLM3ForCausalLM(config)).save_pretrained(folder)


def make_phi4_mini(folder: Path) -> None:
    """Phi-4-mini's shape in small: LongRoPE over 3/4 of heads of 64 (24 factors), tied head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    vocab = save_tokenizer(folder, gpt2_class=True)
    torch.manual_seed(0)
    factors = torch.Generator().manual_seed(5)
    config = Phi3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, original_max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2,
        sliding_window=None,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": (1 + torch.rand(24, generator=factors) * 0.5).tolist(),
            "long_factor": (1 + torch.rand(24, generator=factors) * 20).tolist(),
        },
    )  # fmt: skip
    nudged(Phi3ForCausalLM(config)).save_pretrained(folder)


def convert(folder: Path, out: Path, llama_cpp: Path, extra_path: str) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(llama_cpp / "gguf-py"), str(llama_cpp), extra_path])),
    )
    converter = str(llama_cpp / "convert_hf_to_gguf.py")
    command = [sys.executable, "-c", CONVERT, converter, str(folder), "--outtype", "f32", "--outfile", str(out / f"{folder.name}-F32.gguf")]  # fmt: skip
    subprocess.run(command, check=True, env=env, cwd=llama_cpp, capture_output=True)
    for kind in ("Q8_0", "Q4_K_M"):
        quantize = [str(llama_cpp / "build-native/bin/llama-quantize"), str(out / f"{folder.name}-F32.gguf")]
        subprocess.run(
            [*quantize, str(out / f"{folder.name}-{kind}.gguf"), kind], check=True, capture_output=True
        )


def llama_cpp_logits(
    path: Path, ids: list[int], n_ctx: int, llama_cpp: Path, extra_path: str
) -> torch.Tensor:
    """llama.cpp's logits (L, V) for `ids`, from llama-cpp-python over the tree's own build."""
    package = llama_cpp.parent.parent  # the source distribution that vendors the tree
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(package), extra_path])))
    env["LLAMA_CPP_LIB_PATH"] = str(llama_cpp / "build-native/bin")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        command = [sys.executable, "-c", EVALUATE, str(path), str(out), ",".join(map(str, ids)), str(n_ctx)]
        subprocess.run(command, check=True, env=env, capture_output=True)
        return torch.from_numpy(np.load(out))


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def kl_divergence(expected: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over positions of KL(expected || got), in nats."""
    p, q = torch.log_softmax(expected.double(), -1), torch.log_softmax(got.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def check(name: str, out: Path, cases: list[tuple[int, int]], greedy: tuple[int, int], args) -> dict:
    from transformers import AutoModelForCausalLM

    folder = out / name
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    report = {}
    ids = torch.randint(
        3,
        reference.config.vocab_size,
        (max(n for n, _ in cases),),
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        for source, kwargs in ((folder, {}), (out / f"{name}-F32.gguf", {"quantize": None})):
            report[f"float {Path(source).name}"] = relative(
                flashformer.from_pretrained(source, **kwargs)(ids[None]).logits[0], expected
            )
    prompt, new = greedy
    theirs = reference.generate(ids[None, :prompt], max_new_tokens=new, do_sample=False, eos_token_id=None)
    model, _ = flashformer.load(out / f"{name}-F32.gguf")
    ours = model.generate(ids[None, :prompt], max_new_tokens=new, do_sample=False, eos_token_id=None)
    report[f"greedy {prompt}+{new} equal"] = bool(torch.equal(ours, theirs))
    for length, n_ctx in cases:
        with torch.no_grad():
            float_logits = reference(ids[None, :length]).logits[0]
        for kind in ("Q8_0", "Q4_K_M"):
            path = out / f"{name}-{kind}.gguf"
            model, _ = flashformer.load(path)
            with torch.no_grad():
                ours = model(ids[None, :length]).logits[0]
            theirs = llama_cpp_logits(path, ids[:length].tolist(), n_ctx, args.llama_cpp_src, args.extra_path)
            report[f"{kind} at {length} (n_ctx {n_ctx})"] = {
                "max_error": {"flashformer": relative(ours, float_logits), "llama.cpp": relative(theirs, float_logits)},
                "kl_divergence": {"flashformer": kl_divergence(float_logits, ours), "llama.cpp": kl_divergence(float_logits, theirs)},
            }  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp-src", type=Path, required=True)
    parser.add_argument("--extra-path", default="", help="where sentencepiece and diskcache are installed")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "new_dense_check")
    args = parser.parse_args()
    for name, make in (("smollm3", make_smollm3), ("phi4mini", make_phi4_mini)):
        (args.out / name).mkdir(parents=True, exist_ok=True)
        make(args.out / name)
        convert(args.out / name, args.out, args.llama_cpp_src, args.extra_path)
    report = {
        "smollm3": check("smollm3", args.out, [(100, 128)], (20, 40), args),
        "phi4mini": check("phi4mini", args.out, [(200, 256), (300, 512)], (200, 100), args),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
