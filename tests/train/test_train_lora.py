"""LoRA fine-tuning with the trainer (`flashformer train --base MODEL --lora`): the base frozen,
checkpoints holding the adapter alone, an exact resume (bitwise, as a full run's), the run loaded
back as base + adapter, and the adapter written as a PEFT folder that peft reads onto the
transformers model with the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flashformer
from flashformer.adapters import lora_layers
from flashformer.checkpoints import checkpoint as ckpt
from flashformer.cli import commands as cli
from flashformer.train.config import TrainConfig
from flashformer.train.trainer import Trainer
from tests.helpers import relative_error
from tests.helpers.gguf import cycle_types, llama_metadata, llama_tensors, tiny_llama, write_gguf

WORDS = "the and 12 there in answer".split()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny LLaMA as a Hugging Face folder with a tokenizer (a float GGUF file's, saved)."""
    folder = tmp_path_factory.mktemp("lora-base")
    model = tiny_llama()
    path = write_gguf(
        folder / "tiny.gguf", "llama", llama_metadata(model), llama_tensors(model, cycle_types("F32"))
    )
    float_model, tokenizer = flashformer.load(path, quantize=None)
    float_model.save_pretrained(folder / "hf")
    tokenizer.save(folder / "hf")
    return folder / "hf"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-corpus")
    generator = torch.Generator().manual_seed(0)
    for i in range(30):
        order = torch.randint(0, len(WORDS), (60,), generator=generator).tolist()
        (folder / f"doc{i}.txt").write_text(" ".join(WORDS[j] for j in order) + "\n")
    return folder


def lora_config(base, corpus, **changes) -> TrainConfig:
    values = dict(
        data=[str(corpus)],
        base=str(base),
        lora_rank=4,
        lora_alpha=8.0,
        lora_targets=["q_proj", "v_proj", "down_proj"],
        seq_len=16,
        batch_size=4,
        max_steps=6,
        lr=1e-2,
        warmup_steps=1,
        eval_every=3,
        eval_batches=1,
        log_every=2,
        save_every=3,
        sample_tokens=0,  # no sample: the run's speed is its steps
        val_fraction=0.1,
        export_hf=False,
    )
    return TrainConfig(**(values | changes))


def test_the_base_stays_frozen_and_checkpoints_hold_the_adapter_alone(base, corpus, tmp_path):
    original = flashformer.from_pretrained(base).state_dict()
    trainer = Trainer(None, lora_config(base, corpus), tmp_path, show_progress=False)
    summary = trainer.fit()
    saved = load_file(str(Path(summary["checkpoint"]) / ckpt.WEIGHTS))
    assert saved and all(".adapters.lora.A." in k or ".adapters.lora.B." in k for k in saved), sorted(saved)
    assert len(saved) == 2 * 3 * 2  # 2 layers x (q, v: parts of one qkv; down) x (A, B)
    assert any(".attn.qkv.adapters.lora.A.q_proj" in k for k in saved)
    assert all(saved[k].abs().sum() > 0 for k in saved if ".B." in k), "every B has moved from zero"
    for name, tensor in trainer.model.state_dict().items():
        if "adapters" not in name:
            assert torch.equal(tensor, original[name.replace(".base.", ".")]), name
    assert summary["val_loss"] < 10


def test_resume_reaches_the_same_adapter_bitwise(base, corpus, tmp_path):
    # dropout on the adapter's input, so the restored RNG streams matter as much as the data position
    config = dict(deterministic=True, lora_dropout=0.1)
    straight = Trainer(None, lora_config(base, corpus, **config), tmp_path / "a", show_progress=False).fit()
    first = Trainer(None, lora_config(base, corpus, **config), tmp_path / "b", show_progress=False)
    first.fit(until_step=4)
    resumed = Trainer(
        None, lora_config(base, corpus, **config), tmp_path / "b", resume=True, show_progress=False
    )
    assert resumed.step == 4
    end = resumed.fit()
    a = load_file(str(Path(straight["checkpoint"]) / ckpt.WEIGHTS))
    b = load_file(str(Path(end["checkpoint"]) / ckpt.WEIGHTS))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_cli_trains_an_adapter_that_peft_and_load_read_alike(base, corpus, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = [
        "train",
        "--base",
        str(base),
        "--lora",
        "--lora-rank",
        "4",
        "--lora-targets",
        "q_proj,k_proj,up_proj",
    ]
    args += ["--data", str(corpus), "--out", str(out), "--max-steps", "4", "--no-progress"]
    args += ["--train.seq_len", "16", "--train.batch_size", "4", "--train.eval_every", "4"]
    args += ["--train.save_every", "4", "--train.sample_tokens", "4", "--train.sample_prompt", "the"]
    cli.main(args)
    config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["k_proj", "q_proj", "up_proj"]
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    ours, _ = flashformer.load(out)  # the run: its base, read again, and its adapter
    assert lora_layers(ours)
    with torch.no_grad():
        got = ours(ids).logits
        plain = flashformer.from_pretrained(base)(ids).logits
        theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "peft").eval()
        expected = theirs(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()(ids).logits  # export_hf: merged
    assert relative_error(plain, expected) > 1e-4, "the trained adapter changes the logits"
    assert relative_error(got, expected) < 1e-4
    assert relative_error(merged, expected) < 1e-4


def test_lora_settings_are_checked(base, corpus, tmp_path):
    with pytest.raises(ValueError, match="train.lora_rank=4: an adapter needs train.base"):
        Trainer(None, dataclasses.replace(lora_config(base, corpus), base=""), tmp_path, show_progress=False)
    with pytest.raises(ValueError, match=r"target modules \['qq_proj'\] match no projection.*'q_proj'"):
        Trainer(None, lora_config(base, corpus, lora_targets=["qq_proj"]), tmp_path, show_progress=False)


@pytest.mark.slow  # ~15 s: two runs' setup and peft's by hand
def test_the_trained_adapter_equals_peft_trained_on_the_same_batches(base, corpus, tmp_path):
    """peft's adapter on transformers' model, from the same A (B zero), trained by hand with the
    trainer's recipe (AdamW, decay on matrices, warmup + cosine, clipping) on the same batches,
    ends at the same A and B and the same validation loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flashformer.adapters.peft import part_name, targets
    from flashformer.model.models import cross_entropy
    from flashformer.train.trainer import learning_rate, parameter_groups

    config = lora_config(base, corpus, max_steps=5, eval_every=5, save_every=5)
    trainer = Trainer(None, config, tmp_path / "ours", show_progress=False)
    where = {(t.module, part_name(full)): full for full, t in targets(trainer.model).items()}

    def ours_by_peft_name():
        found = {}
        for module, layer in lora_layers(trainer.model).items():
            for factor in "AB":
                for part, p in getattr(layer.adapters["lora"], factor).items():
                    found[f"base_model.model.{where[(module, part)]}.lora_{factor}.default.weight"] = p
        return found

    theirs = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, lora_alpha=8.0, target_modules=config.lora_targets, lora_dropout=0.0),
    )
    trained = dict(theirs.named_parameters())
    with torch.no_grad():
        for name, p in ours_by_peft_name().items():
            trained[name].copy_(p)  # the same A; B zero on both sides
    draw = Trainer(None, config, tmp_path / "batches", show_progress=False)  # the same sampler
    batches = [
        draw.objective.train_batch(draw.sampler.next_indices(config.batch_size), draw.generator)
        for _ in range(config.max_steps)
    ]
    optimizer = torch.optim.AdamW(
        parameter_groups(theirs, config.weight_decay), lr=config.lr, betas=(config.beta1, config.beta2)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: learning_rate(s, config) / config.lr)
    theirs.train()
    for batch in batches:
        cross_entropy(theirs(batch["input_ids"]).logits, batch["targets"]).backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), config.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()

    summary = trainer.fit()
    ours = ours_by_peft_name()
    for name, p in ours.items():
        assert relative_error(p.detach(), trained[name].detach()) < 1e-4, name
    theirs.eval()
    with torch.no_grad():
        losses = []
        val = draw.objective
        count = min(len(val.run_data.val), config.eval_batches * config.batch_size)
        order = torch.randperm(len(val.run_data.val), generator=torch.Generator().manual_seed(config.seed))
        windows = val.run_data.val.windows(order[:count].tolist())
        losses.append(cross_entropy(theirs(windows[:, :-1]).logits, windows[:, 1:]).item())
    assert summary["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)


@pytest.mark.slow  # ~14 s
def test_an_adapter_trains_beside_a_gguf_files_quantized_blocks(corpus, tmp_path):
    """--base-quantize gguf (QLoRA's way): the blocks stay the file's, the gradient reaches the
    adapters through them (each layer's input gradient: tests/kernels), and the run loads back as
    the same quantized base with its adapter."""
    from flashformer.kernels.quantized import ConcatenatedLinear, QuantizedLinear

    model = tiny_llama()
    path = write_gguf(
        tmp_path / "q.gguf", "llama", llama_metadata(model), llama_tensors(model, cycle_types("Q8_0", "Q4_0"))
    )
    config = lora_config(path, corpus, base_quantize="gguf", max_steps=3, eval_every=3, save_every=3)
    trainer = Trainer(None, config, tmp_path / "run", show_progress=False)
    summary = trainer.fit()
    layers = lora_layers(trainer.model)
    assert all(isinstance(layer.base, QuantizedLinear | ConcatenatedLinear) for layer in layers.values())
    saved = load_file(str(Path(summary["checkpoint"]) / ckpt.WEIGHTS))
    assert saved and all(saved[k].abs().sum() > 0 for k in saved if ".B." in k), "every B has moved"
    plain, _ = flashformer.load(path)
    for name, buffer in trainer.model.named_buffers():
        if "qweight" in name:
            assert torch.equal(buffer, plain.get_buffer(name.replace(".base.", "."))), name
    ids = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(2))
    loaded, _ = flashformer.load(tmp_path / "run")
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, trainer.model(ids).logits)
