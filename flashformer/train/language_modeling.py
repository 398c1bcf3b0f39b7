"""The objective of `flashformer train`: language modelling on packed windows of a corpus.

One objective per family, from the same windows of seq_len + 1 tokens: next-token prediction
(decoders), BERT's masked LM (encoders), T5's span corruption (encoder-decoders). The Trainer
(train/trainer.py) runs any objective with this interface; the fine-tuning tasks are the others
(encoders/objectives.py):

    tokenizer                  saved with every checkpoint
    model_config(config)       the config to train (here: the vocabulary follows the tokenizer)
    initialize(model)          weights before step 0 (here: build()'s random ones)
    train_size                 examples the sampler draws from (here: windows)
    train_batch(indices, generator), loss(model, batch), tokens(batch)
    evaluate(trainer)          the held-out figures logged at each evaluation
    describe(), summary(), sample(trainer), checkpoint_files(), checkpoint_config(), finish(trainer)
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from flashformer.model.config import CAUSAL_ARCHS
from flashformer.model.models import cross_entropy
from flashformer.text.bpe import EOS, MASK, NUM_SENTINELS, SPECIAL_TOKENS
from flashformer.train.loss_plot import plot_losses
from flashformer.train.run_folder import prepare_data


def make_batch(arch: str, windows: torch.Tensor, tokenizer, generator: torch.Generator) -> dict:
    """Windows of seq_len + 1 tokens -> one family's inputs and targets.

    decoder: next-token prediction, targets[t] = windows[t + 1];
    encoder: BERT's masked LM; encoder-decoder: T5's span corruption.
    """
    if arch == "decoder":
        return {"input_ids": windows[:, :-1], "targets": windows[:, 1:]}
    if arch == "encoder":
        return masked_lm_batch(windows, tokenizer, generator)
    return span_corruption_batch(windows, tokenizer, generator)


def batch_loss(model, batch: dict) -> torch.Tensor:
    if "targets" in batch:  # next-token targets are already aligned: no shift inside the model
        return cross_entropy(model(input_ids=batch["input_ids"]).logits, batch["targets"])
    return model(**batch).loss


class LanguageModeling:
    """Packed windows of a corpus (run_folder.prepare_data: tokenizer and token files made once)."""

    def __init__(self, config, data_dir: Path, is_main: bool, show_progress: bool):
        self.config, self.data_dir = config, Path(data_dir)
        self.run_data = prepare_data(config, self.data_dir, is_main, show_progress)
        self.tokenizer = self.run_data.tokenizer
        self.arch = None  # set by model_config

    def model_config(self, model_config):
        # the recurrent families are next-token language models like a decoder
        self.arch = "decoder" if model_config.arch in CAUSAL_ARCHS else model_config.arch
        return model_config.replace(vocab_size=self.tokenizer.vocab_size)

    def initialize(self, model) -> None:
        """Pretraining starts from build()'s random weights."""

    @property
    def train_size(self) -> int:
        return len(self.run_data.train)

    def train_batch(self, indices: list[int], generator: torch.Generator) -> dict:
        return make_batch(self.arch, self.run_data.train.windows(indices), self.tokenizer, generator)

    def loss(self, model, batch: dict) -> torch.Tensor:
        return batch_loss(model, batch)

    def tokens(self, batch: dict) -> int:
        """Corpus tokens a batch covers: its windows times seq_len."""
        return len(next(iter(batch.values()))) * self.config.seq_len

    @torch.no_grad()
    def evaluate(self, trainer) -> dict:
        """Validation loss on a fixed set of windows (the same at every evaluation)."""
        cfg, dist = self.config, trainer.dist
        world = dist.world_size
        count = min(len(self.run_data.val), cfg.eval_batches * cfg.batch_size * world) // world * world
        order = torch.randperm(len(self.run_data.val), generator=torch.Generator().manual_seed(cfg.seed))
        mine = order[:count][dist.rank :: dist.world_size].tolist()
        generator = torch.Generator().manual_seed(cfg.seed + 1)  # same masks / spans every evaluation
        trainer.train_model.eval()
        losses = []
        for start in range(0, len(mine), cfg.batch_size):
            windows = self.run_data.val.windows(mine[start : start + cfg.batch_size])
            batch = trainer.to_device(make_batch(self.arch, windows, self.tokenizer, generator))
            with trainer.autocast():
                losses.append(batch_loss(trainer.train_model, batch).item())
        val_loss = dist.all_mean(sum(losses) / max(1, len(losses)))
        result = {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50))}
        if self.arch == "decoder":  # a per-byte figure is meaningful for next-token loss
            result["val_bits_per_byte"] = val_loss / math.log(2) / self.run_data.val_bytes_per_token
        return result

    def sample(self, trainer, seed: int = 0) -> str:
        """A continuation of the sample prompt (decoders), for a look at what the model learned."""
        model = trainer.model
        if self.arch != "decoder" or not hasattr(model, "generate"):
            return ""
        prompt = self.tokenizer.encode(self.config.sample_prompt) or [self.tokenizer.token_id(EOS)]
        input_ids = torch.tensor([prompt], device=trainer.device)
        new_tokens = self.config.sample_tokens
        if trainer.model_config.position == "learned":  # no positions beyond the table
            new_tokens = min(new_tokens, trainer.model_config.max_seq_len - len(prompt))
        if new_tokens < 1:
            return ""
        model.eval()
        with torch.no_grad(), trainer.autocast():
            out = model.generate(
                input_ids, max_new_tokens=new_tokens, do_sample=True, temperature=0.8, top_k=50, seed=seed
            )
        return self.tokenizer.decode(out[0].tolist())

    def describe(self, trainer) -> str:
        cfg = self.config
        tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * trainer.dist.world_size
        return (
            f"{tokens_per_step} tokens per step; unigram entropy of the validation text "
            f"{self.run_data.unigram_bits_per_byte:.3f} bits/byte"
        )

    def summary(self) -> dict:
        return {"unigram_bits_per_byte": self.run_data.unigram_bits_per_byte}

    def checkpoint_files(self) -> dict[str, str]:
        return {"tokenizer.json": (self.data_dir / "tokenizer.json").read_text()}

    def checkpoint_config(self) -> dict:
        return {}

    def finish(self, trainer) -> None:
        plot_losses(
            trainer.out_dir / "metrics.jsonl",
            trainer.out_dir / "loss.png",
            self.run_data.unigram_bits_per_byte,
        )


# ---- one batch of windows -> the model inputs of a family ----


def special_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.token_id(t) for t in SPECIAL_TOKENS])


def masked_lm_batch(
    windows: torch.Tensor, tokenizer, generator: torch.Generator, mask_prob: float = 0.15
) -> dict:
    """BERT's objective: 15 % of the (non-special) tokens are chosen; of those
    80 % become <mask>, 10 % a random token, 10 % stay. Labels are the chosen
    tokens' ids, -100 elsewhere (ignored by the loss)."""
    input_ids = windows[:, :-1].clone()  # (B, L)
    specials = special_ids(tokenizer)
    chosen = (torch.rand(input_ids.shape, generator=generator) < mask_prob) & ~torch.isin(input_ids, specials)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    roll = torch.rand(input_ids.shape, generator=generator)
    input_ids[chosen & (roll < 0.8)] = tokenizer.token_id(MASK)
    randomize = chosen & (roll >= 0.8) & (roll < 0.9)
    ordinary = torch.tensor(sorted(set(range(tokenizer.vocab_size)) - set(specials.tolist())))
    picks = torch.randint(len(ordinary), (int(randomize.sum()),), generator=generator)
    input_ids[randomize] = ordinary[picks]
    return {"input_ids": input_ids, "labels": labels}


def span_corruption_lengths(length: int, noise_density: float = 0.15, mean_span: float = 3.0):
    """(noise tokens, spans, encoder input length, target length) for a window."""
    noise = min(max(1, round(length * noise_density)), length - 1)
    spans = max(1, min(round(noise / mean_span), noise, length - noise))
    return noise, spans, length - noise + spans + 1, noise + spans + 1


def span_corruption_batch(
    windows: torch.Tensor,
    tokenizer,
    generator: torch.Generator,
    noise_density: float = 0.15,
    mean_span: float = 3.0,
) -> dict:
    """T5's objective: about 15 % of the tokens, in spans of mean length 3, are
    cut out; each span becomes one sentinel (<extra_id_k>) in the input, and
    the target lists each sentinel followed by the tokens it replaced.

    Lengths depend only on the window length, so a batch needs no padding.
    """
    tokens = windows[:, :-1]  # (B, L)
    length = tokens.shape[1]
    noise, spans, _, _ = span_corruption_lengths(length, noise_density, mean_span)
    if spans > NUM_SENTINELS:
        raise ValueError(
            f"{spans} noise spans need more than the {NUM_SENTINELS} sentinel tokens; shorten seq_len"
        )
    sentinels = [tokenizer.token_id(f"<extra_id_{k}>") for k in range(spans)]
    eos = tokenizer.token_id(EOS)
    inputs, targets = [], []
    for row in tokens.tolist():
        noise_lengths = _random_segmentation(noise, spans, generator)
        keep_lengths = _random_segmentation(length - noise, spans, generator)
        source, target, start = [], [], 0
        for k in range(spans):  # keep, noise, keep, noise, ... (T5 starts with kept text)
            source += row[start : start + keep_lengths[k]] + [sentinels[k]]
            start += keep_lengths[k]
            target += [sentinels[k]] + row[start : start + noise_lengths[k]]
            start += noise_lengths[k]
        inputs.append(source + [eos])
        targets.append(target + [eos])
    return {"input_ids": torch.tensor(inputs), "labels": torch.tensor(targets)}


def _random_segmentation(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """Split `total` items into `parts` segments of length >= 1, uniformly."""
    cuts = (torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).sort().values.tolist()
    bounds = [0] + cuts + [total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]
