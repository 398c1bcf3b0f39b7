"""`flashformer cost` and `flashformer viz`: what they print and write, the
inputs they read (presets, config files, trainer checkpoints, HF folders),
the errors they give, and the curves behind the positional plot against
their closed forms."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import flop_counter
from transformers import GPT2Config, GPT2LMHeadModel

import flashformer
from flashformer import costs
from flashformer.cli import commands as cli
from flashformer.costs import report
from flashformer.model.presets import preset
from flashformer.viz import attention as viz_attention
from flashformer.viz import positional

# ---- flashformer cost ----


def test_cost_prints_the_estimate_and_writes_json_and_png(tmp_path, capsys):
    """The written figures against the model itself: its parameters, the
    FLOPs torch's counter sees in a forward of 300 new tokens after 40
    cached ones (batch 2, the flash backend's tiles), and the cache's bytes."""
    from flashformer.generate.cache import make_caches

    cli.main(
        ["cost", "llama-tiny", "--seq-len", "300", "--cache", "40", "--batch", "2", "--out", str(tmp_path)]
    )
    printed = capsys.readouterr().out
    written = json.loads((tmp_path / "cost.json").read_text())

    torch.manual_seed(0)
    model = flashformer.build("llama-tiny", attention_backend="flash", max_seq_len=512).eval()
    caches = make_caches(model, 2, 340)
    ids = torch.randint(0, model.config.vocab_size, (2, 340))
    with torch.no_grad():
        model(ids[:, :40], kv_caches=caches)
        counter = flop_counter()
        with counter:
            model(ids[:, 40:], kv_caches=caches, cache_position=40)
    assert written["forward_flops"] == counter.get_total_flops()
    assert written["parameters"] == model.num_parameters()
    assert written["kv_cache_bytes"] == 2 * 2 * 40 * 2 * 16 * 4 * 2  # 2·L·c·h_kv·d_k·4·B
    for line in ("Q projection", "feed-forward", "decode step", "KV cache (c = 40)", "HBM traffic"):
        assert line in printed
    assert report.format_count(written["forward_flops"]) in printed
    assert (tmp_path / "cost.png").stat().st_size < 300_000


def test_cost_reads_config_files_checkpoints_and_hf_folders(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model:\n  preset: gpt2-tiny\n  n_layers: 3\n")
    assert costs.resolve_config(str(yaml_file)) == preset("gpt2-tiny", n_layers=3)

    checkpoint = tmp_path / "step-0000010"
    checkpoint.mkdir()
    config = preset("t5-tiny", d_ff=96)
    (checkpoint / "config.json").write_text(json.dumps({"model": config.to_dict(), "train": {}}))
    assert costs.resolve_config(str(checkpoint)) == config

    hf_folder = tmp_path / "hf"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=40)
    ).save_pretrained(hf_folder)
    from_hf = costs.resolve_config(str(hf_folder))
    assert (from_hf.d_model, from_hf.n_layers, from_hf.vocab_size, from_hf.max_seq_len) == (32, 2, 97, 40)
    assert costs.parameter_count(from_hf) == sum(
        p.numel() for p in GPT2LMHeadModel.from_pretrained(hf_folder).parameters()
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cost", "gpt-7"], "neither a preset"),
        (["cost", "gpt2-tiny", "--seq-len", "0"], "seq_len must be an int >= 1; got 0"),
        (["cost", "bert-tiny", "--cache", "8"], "an encoder keeps no KV cache; got cache_len=8"),
        (["cost", "gpt2-tiny", "--decoder-len", "8"], "decoder_len is for encoder-decoder models"),
        (["cost", "gpt2-tiny", "--dtype", "float31"], "dtype must be a torch.dtype or its name"),
    ],
)
def test_cost_errors_name_the_argument(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--out", str(tmp_path), "--no-plot"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ---- flashformer viz attention ----


def test_viz_attention_of_a_trainer_run(tiny_run, tmp_path):
    model, encode, _ = viz_attention.load(tiny_run)
    tokens = encode("def f(x):")
    assert tokens.labels[:4] == ["d", "e", "f", " "] and len(tokens.ids) == 9
    maps = viz_attention.attention_maps(model, tokens)["decoder"]
    assert len(maps) == 2 and maps[0].shape == (2, 9, 9)
    assert torch.allclose(maps[1].sum(-1), torch.ones(2, 9)) and maps[1].triu(1).abs().max() == 0  # causal

    out = tmp_path / "maps.png"
    cli.main(["viz", "attention", str(tiny_run), "--text", "def f(x):", "--heads", "1", "--out", str(out)])
    assert 0 < out.stat().st_size < 300_000


def test_viz_attention_of_an_hf_folder_with_t5(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(
        T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=2, num_heads=4)
    ).save_pretrained(tmp_path / "t5")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 5, "cat": 6, "sat": 7}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "t5" / "tokenizer.json"))
    out = tmp_path / "t5.png"
    cli.main(
        [
            "viz",
            "attention",
            str(tmp_path / "t5"),
            "--text",
            "the cat sat",
            "--decoder-text",
            "cat",
            "--out",
            str(out),
        ]
    )
    for kind in ("encoder", "decoder", "cross"):
        assert (tmp_path / f"t5-{kind}.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layers", "7"], "--layers: [7] out of range; the model has 2 layers"),
        (["--max-tokens", "3"], "--text has 9 tokens; give 1 to --max-tokens=3"),
    ],
)
def test_viz_attention_errors_name_the_argument(tiny_run, tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(
            [
                "viz",
                "attention",
                str(tiny_run),
                "--text",
                "def f(x):",
                "--out",
                str(tmp_path / "m.png"),
                *extra,
            ]
        )
    assert message in capsys.readouterr().err


def test_viz_attention_refuses_a_folder_without_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["viz", "attention", str(tmp_path), "--text", "x"])
    assert "is neither a run folder (no step-* checkpoint inside)" in capsys.readouterr().err


# ---- flashformer viz positional ----


def test_positional_curves_match_their_closed_forms(tmp_path):
    distances = torch.arange(0, 300)
    dim = 64
    frequencies = [10000 ** (-2 * i / dim) for i in range(dim // 2)]
    expected = [sum(math.cos(d * w) for w in frequencies) for d in distances.tolist()]
    assert torch.allclose(
        positional.sinusoidal_similarity(distances, dim, position=17), torch.tensor(expected), atol=1e-3
    )
    # RoPE, q = k = 1: each channel pair (i, i + d/2) contributes 2·cos(Δ·θ_i)
    expected = [sum(2 * math.cos(d * w) for w in frequencies) for d in distances.tolist()]
    assert torch.allclose(positional.rope_similarity(distances, dim), torch.tensor(expected), atol=1e-3)

    out = tmp_path / "positional.png"
    cli.main(["viz", "positional", "--out", str(out), "--dim", "64", "--heads", "12"])
    assert 0 < out.stat().st_size < 300_000
