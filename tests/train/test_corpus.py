"""Corpora, tokenizers, token files, the resumable sampler and the objectives."""

from __future__ import annotations

import torch

from flashformer.text import bpe
from flashformer.train import corpus, language_modeling


def write_corpus(folder, texts):
    for i, text in enumerate(texts):
        (folder / f"doc{i}.py").write_text(text)
    return corpus.resolve_corpus([str(folder)])


def test_default_corpus_is_the_standard_library():
    docs = corpus.stdlib_corpus()
    names = {d.name for d in docs}
    assert len(docs) > 300 and "os.py" in names and "json/decoder.py" in names
    assert not any("site-packages" in d.name or d.name.startswith("test/") for d in docs)


def test_split_is_deterministic_and_disjoint(tmp_path):
    docs = write_corpus(tmp_path, [f"x = {i}\n" for i in range(200)])
    train, val = corpus.split_documents(docs, 0.1, seed=3)
    again_train, again_val = corpus.split_documents(list(reversed(docs)), 0.1, seed=3)
    assert {d.name for d in val} == {d.name for d in again_val}
    assert not {d.name for d in train} & {d.name for d in val}
    assert len(train) + len(val) == 200 and 5 <= len(val) <= 40


def test_missing_data_path_is_named(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="nothing_here"):
        corpus.resolve_corpus([str(tmp_path / "nothing_here")])


def test_tokenizers_round_trip_and_save(tmp_path):
    docs = write_corpus(tmp_path, ["def f(x):\n    return x + 1\n" * 50, "class A:\n    pass\n" * 50])
    text = "def g(y):\n    return y * 2  # é\n"
    byte = bpe.ByteTokenizer()
    assert byte.decode(byte.encode(text)) == text
    trained = bpe.train_bpe([corpus.read_text(d.path) for d in docs], vocab_size=400, show_progress=False)
    assert trained.decode(trained.encode(text)) == text
    assert len(trained.encode("def f(x):\n    return x + 1\n")) < len(
        byte.encode("def f(x):\n    return x + 1\n")
    )
    out = tmp_path / "ckpt"
    trained.save(out)
    assert bpe.read_saved_tokenizer(out).encode(text) == trained.encode(text)
    byte.save(tmp_path / "b")
    assert isinstance(bpe.read_saved_tokenizer(tmp_path / "b"), bpe.ByteTokenizer)


def test_token_file_packs_documents_with_eos(tmp_path):
    docs = write_corpus(tmp_path, ["ab", "cde"])
    tok = bpe.ByteTokenizer()
    path = corpus.write_token_file(docs, tok, tmp_path / "train.bin", show_progress=False)
    tokens = corpus.open_token_file(path)
    eos = tok.token_id(bpe.EOS)
    assert tokens.tolist() == [97, 98, eos, 99, 100, 101, eos]
    packed = corpus.PackedSequences(tokens, seq_len=3)
    assert len(packed) == 2
    assert packed.windows([0, 1]).tolist() == [[97, 98, eos, 99], [99, 100, 101, eos]]


def test_sampler_shards_and_resumes():
    full = corpus.ShardedSampler(10, seed=1)
    order = full.next_indices(25)  # crosses two epoch boundaries
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    ranks = [corpus.ShardedSampler(10, seed=1, rank=r, world_size=2) for r in range(2)]
    shards = [r.next_indices(5) for r in ranks]
    assert sorted(shards[0] + shards[1]) == list(range(10))
    sampler = corpus.ShardedSampler(10, seed=1)
    sampler.next_indices(13)
    state = sampler.state_dict()
    resumed = corpus.ShardedSampler(10, seed=1)
    resumed.load_state_dict(state)
    assert resumed.next_indices(12) == order[13:25]


def test_masked_lm_batch_follows_80_10_10():
    tok = bpe.ByteTokenizer()
    windows = torch.randint(0, 256, (64, 513))
    batch = language_modeling.masked_lm_batch(windows, tok, torch.Generator().manual_seed(0))
    chosen = batch["labels"] != -100
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    original = windows[:, :-1]
    assert torch.equal(batch["labels"][chosen], original[chosen])
    masked = batch["input_ids"][chosen] == tok.token_id(bpe.MASK)
    unchanged = batch["input_ids"][chosen] == original[chosen]
    assert abs(masked.float().mean().item() - 0.8) < 0.02
    assert abs(unchanged.float().mean().item() - 0.1) < 0.02  # kept, plus the rare random pick of itself
    assert torch.equal(batch["input_ids"][~chosen], original[~chosen])


def test_span_corruption_reconstructs_the_text():
    tok = bpe.ByteTokenizer()
    windows = torch.randint(0, 256, (8, 101))
    batch = language_modeling.span_corruption_batch(windows, tok, torch.Generator().manual_seed(0))
    noise, spans, in_len, out_len = language_modeling.span_corruption_lengths(100)
    assert batch["input_ids"].shape == (8, in_len) and batch["labels"].shape == (8, out_len)
    sentinel = {tok.token_id(f"<extra_id_{k}>"): k for k in range(spans)}
    for row, source, target in zip(
        windows[:, :-1].tolist(), batch["input_ids"].tolist(), batch["labels"].tolist()
    ):
        pieces, current = {}, None
        for t in target[:-1]:
            if t in sentinel:
                current = sentinel[t]
                pieces[current] = []
            else:
                pieces[current].append(t)
        rebuilt = []
        for t in source[:-1]:
            rebuilt += pieces[sentinel[t]] if t in sentinel else [t]
        assert rebuilt == row
        assert sum(len(p) for p in pieces.values()) == noise
