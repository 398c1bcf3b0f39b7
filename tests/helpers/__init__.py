"""What several test modules share: tiny transformers models of each family,
perturbed weights, the smallest KV cache, a tiny trained run."""

from __future__ import annotations

import torch

VOCAB = 97  # every tiny model's vocabulary: a prime, so no size lines up by chance


def hf_config(family: str, **changes):
    """A transformers config of `family` ("bert", "gpt2", "t5", "llama", "qwen2", "phi3"), tiny,
    with `changes`."""
    from transformers import BertConfig, GPT2Config, LlamaConfig, Phi3Config, Qwen2Config, T5Config

    kind, values = {
        "bert": (
            BertConfig,
            dict(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=44,
                max_position_embeddings=40,
                type_vocab_size=3,
            ),
        ),
        "gpt2": (GPT2Config, dict(n_embd=32, n_layer=2, n_head=4, n_positions=40)),
        # 12-distance buckets: crossed by sequences of 13 and more
        "t5": (
            T5Config,
            dict(
                d_model=32,
                d_kv=6,
                d_ff=44,
                num_layers=2,
                num_decoder_layers=3,
                num_heads=5,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=12,
            ),
        ),
        "llama": (
            LlamaConfig,
            dict(
                hidden_size=32,
                intermediate_size=44,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            ),
        ),
        "qwen2": (
            Qwen2Config,
            dict(
                hidden_size=32,
                intermediate_size=44,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            ),
        ),
        # head_dim 16: a partial rotary factor of 0.75 rotates 12 channels of each head
        "phi3": (
            Phi3Config,
            dict(
                hidden_size=32,
                intermediate_size=44,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=64,
                original_max_position_embeddings=64,
                pad_token_id=0,
            ),
        ),
    }[family]
    return kind(**dict(values, vocab_size=VOCAB, **changes))


def perturbed(module: torch.nn.Module, scale: float = 0.2, seed: int = 1) -> torch.nn.Module:
    """Every parameter moved by Gaussian noise, in eval mode. Initialization
    leaves norms at 1 and biases at 0, which would hide a mapping mistake."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
    return module.eval()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference over the largest expected magnitude."""
    return ((got - expected).abs().max() / expected.abs().max()).item()


class TestCache:
    """The smallest KV cache that meets the layers' protocol (flashformer.generate.cache.KVCache
    is the real one): update() writes at cache_position into preallocated
    (B, Hk, 64, D) tensors; memory_kv holds an encoder-decoder's cross-attention
    keys and values."""

    __test__ = False  # not a test class, despite its name

    def __init__(self):
        self.k = self.v = None
        self.memory_kv = None

    def update(self, k, v, cache_position):
        if self.k is None:
            self.k = torch.zeros(k.shape[0], k.shape[1], 64, k.shape[3], dtype=k.dtype)
            self.v = torch.zeros(v.shape[0], v.shape[1], 64, v.shape[3], dtype=v.dtype)
        end = cache_position + k.shape[2]
        self.k[:, :, cache_position:end], self.v[:, :, cache_position:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]


TINY_RUN_PROMPT = "def "


def train_tiny_run(corpus, out):
    """A real run of the trainer (6 steps, checkpoints at 3 and 6) of a tiny
    byte-level GPT on a corpus of small Python files; returns the trainer's summary."""
    from flashformer.model.presets import preset
    from flashformer.train.config import TrainConfig
    from flashformer.train.trainer import Trainer

    for i in range(20):
        (corpus / f"file{i}.py").write_text("def add(a, b):\n    return a + b\n" * (2 + i % 3))
    model_config = preset("gpt2-tiny", n_layers=2, d_model=32, n_heads=2, d_ff=64, max_seq_len=64)
    train_config = TrainConfig(
        data=[str(corpus)],
        tokenizer="byte",
        seq_len=32,
        batch_size=4,
        max_steps=6,
        warmup_steps=1,
        eval_every=3,
        eval_batches=1,
        save_every=3,
        log_every=3,
        sample_tokens=8,
        sample_prompt=TINY_RUN_PROMPT,
        val_fraction=0.1,
    )
    return Trainer(model_config, train_config, out, show_progress=False).fit()


# ---- generation: transformers models and the same models loaded by flashformer ----

PAD, BOS, EOS = 0, 1, 2


def generation_model(family: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, T5ForConditionalGeneration

    tokens = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    if family == "gpt2":
        return GPT2LMHeadModel(hf_config("gpt2", n_positions=48, **tokens))
    if family == "llama-gqa":
        return LlamaForCausalLM(hf_config("llama", **tokens))
    # T5 ids: pad 0 (also the decoder start), eos 1; as many decoder layers as encoder layers, as
    # transformers' generate (its encoder-decoder cache) needs
    return T5ForConditionalGeneration(
        hf_config("t5", num_decoder_layers=2, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    )


GENERATION_FAMILIES = ("gpt2", "llama-gqa", "t5")


_PAIRS: dict[str, tuple] = {}  # built once per family and session (conftest's pair fixtures)


def load_pair(family: str, tmp_path_factory):
    """(family, transformers model, the same model loaded by flashformer)."""
    import flashformer

    if family not in _PAIRS:
        torch.manual_seed(0)
        theirs = perturbed(generation_model(family))
        folder = tmp_path_factory.mktemp(family)
        theirs.save_pretrained(folder)
        _PAIRS[family] = (family, theirs, flashformer.from_pretrained(folder))
    return _PAIRS[family]


def prompts(batch=3, length=7, seed=3):
    torch.manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length))  # no special tokens inside


def left_padded():
    """A batch of prompts of lengths 7, 4 and 2, left-padded, and the prompts alone."""
    ids = prompts()
    lengths = [7, 4, 2]
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, -n:] = 1
    ids = ids.masked_fill(mask == 0, PAD)
    alone = [ids[row : row + 1, -n:] for row, n in enumerate(lengths)]
    return ids, mask, alone


def hf_generate(model, ids, mask=None, **kwargs):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=kwargs.pop("do_sample", False), **kwargs)


def eos_of(family):
    return 1 if family == "t5" else EOS


def assert_same_tokens(mine, theirs, eos: list[int], prompt_len: int):
    """Token for token, with one allowance: transformers' beam search fills the
    rows that ended early with `pad_token_id or eos_token_id[0]`, so with pad
    id 0 it fills with eos; flashformer fills with the pad id. Everything up
    to each row's first eos must be equal, and after it only filler may follow."""
    assert mine.shape == theirs.shape, f"shapes {tuple(mine.shape)} vs {tuple(theirs.shape)}"
    for row in range(mine.shape[0]):
        generated = theirs[row, prompt_len:].tolist()
        end = prompt_len + next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        assert mine[row, :end].tolist() == theirs[row, :end].tolist(), f"row {row} differs"
        assert set(mine[row, end:].tolist()) <= {PAD}, f"row {row}: flashformer's filler is not pad"
        assert set(theirs[row, end:].tolist()) <= {PAD, eos[0]}, f"row {row}: transformers' filler"


def decoder_prompt_len(family, ids):
    return 1 if family == "t5" else ids.shape[1]


# ---- counting FLOPs ----


def _inplace_baddbmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    batch, rows, inner = a_shape
    return 2 * batch * rows * inner * b_shape[2]


def flop_counter():
    """torch's FlopCounterMode, counting the in-place baddbmm_ of the flash backend too."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: _inplace_baddbmm_flops})


def study_payload(runs=("a", "b", "c", "d")):
    """A stored encoder study (encoders.study) with made-up figures, for the study's and the docs' tests."""

    def run(value, minutes):
        return {"metrics": {"accuracy": value, "macro_f1": value - 0.1}, "minutes": minutes}

    values = {"a": (0.5, 1.0), "b": (0.8, 4.0), "c": (0.7, 2.0), "d": (0.4, 2.0)}
    return {
        "machine": {"cpu": "test CPU", "threads": 2, "torch": "2.13.0"},
        "date": "2026-01-01",
        "pretraining": {
            "minutes": 15.0,
            "steps": 4000,
            "tokens": 16e6,
            "val_loss": 3.2,
            "files": 900,
            "held_out_files": 80,
        },
        "tasks": {
            "classification": {
                "metric": "accuracy",
                "baseline": {"accuracy": 0.11, "macro_f1": 0.02},
                "runs": {k: run(*values[k]) for k in runs},
            }
        },
    }


def tiny_chat_folder(folder, max_positions: int):
    """A Hugging Face folder the server tests serve: a 2-layer LLaMA (GQA 4/2) with weights large
    enough that its next-token distributions are peaked (greedy choices far from ties), and
    SmolLM2's tokenizer and chat template; `max_positions` tokens of context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashformer.checkpoints.gguf.packaged_models import smollm2_path
    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer

    tokenizer = read_tokenizer(smollm2_path())
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = perturbed(LlamaForCausalLM(config), scale=0.6)
    model.save_pretrained(folder)
    tokenizer.save(folder)
    return folder


def alternatives_payload():
    """A stored alternatives study (bench/alternatives.py's JSON) with made-up figures: a
    Transformer and an LSTM whose decoding speeds cross at n = 1024 (log-symmetric about it)."""

    def task_run(seed, accuracy):
        return {
            "seed": seed,
            "val_loss": 1.0,
            "accuracy": accuracy,
            "by_distance": {"2-3": accuracy},
            "counts": {"2-3": 10},
            "train_tokens_per_s": 900.0,
            "minutes": 0.5,
        }

    def corpus_run(seed, bits):
        return {
            "seed": seed,
            "val_loss": 2.0,
            "val_bits_per_byte": bits,
            "tokens": 1000,
            "train_tokens_per_s": 1000.0,
            "minutes": 1.0,
        }

    def decode(rates, state):
        return [
            {"n": n, "prefill_s": 1.0, "decode_tokens_per_s": r, "state_bytes": s, "peak_extra_bytes": s}
            for n, r, s in zip((512, 2048), rates, state)
        ]

    payload = {
        "study": "alternatives",
        "machine": {"cpu": "test CPU", "threads": 2, "torch": "2.13.0"},
        "load_average": {"start": [1.0, 1.0, 1.0], "end": [2.0, 2.0, 2.0]},
        "config": {
            "seeds": [0, 1],
            "layers": 2,
            "corpus_steps": 10,
            "batch_size": 8,
            "corpus_seq_len": 256,
            "tokenizer": "bpe",
            "task_steps": 10,
            "task_seq_len": 128,
            "decode_ns": [512, 2048],
            "train_ns": [512],
        },
        "families": {
            "transformer": {
                "summary": "attention",
                "corpus": {"width": 128, "parameters": 658944},
                "tasks": {"width": 128, "parameters": 413440},
            },
            "lstm": {
                "summary": "an LSTM",
                "corpus": {"width": 152, "parameters": 683392},
                "tasks": {"width": 160, "parameters": 432960},
            },
        },
        "corpus": {
            "transformer": {"runs": [corpus_run(0, 1.4), corpus_run(1, 1.6)]},
            "lstm": {"runs": [corpus_run(0, 1.8), corpus_run(1, 2.0)]},
        },
        "tasks": {
            "recall": {
                "transformer": {"runs": [task_run(0, 0.8), task_run(1, 1.0)]},
                "lstm": {"runs": [task_run(0, 0.1), task_run(1, 0.2)]},
            }
        },
        "decode": {
            "transformer": decode((200.0, 100.0), (1 << 20, 1 << 22)),
            "lstm": decode((100.0, 200.0), (2432, 2432)),
        },
        "train_speed": {
            "transformer": [{"n": 512, "tokens_per_s": 3000.0, "peak_extra_bytes": 1 << 24}],
            "lstm": [{"n": 512, "tokens_per_s": 1000.0, "peak_extra_bytes": 1 << 23}],
        },
        "minutes": {"total": 5.0, "training": 4.0, "speed": 1.0},
    }
    from flashformer.bench.alternatives_report import crossovers

    payload["crossovers"] = crossovers(payload)
    return payload
