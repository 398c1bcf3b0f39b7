"""KL divergence from a base model's log-probabilities (flashformer.eval.kld) and its file
(flashformer.eval.base_logits): the bytes of llama-perplexity's --kl-divergence-base format read
by hand, the figures against float64 math on tiny random models, the errors."""

from __future__ import annotations

import copy
import math
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import flashformer
from flashformer.eval.base_logits import read_base_logits, row_width, scored_rows, write_base_logits
from flashformer.eval.kld import (
    bos_to_add,
    cached_chunk_logits,
    chunk_logits,
    file_divergence,
    kl_divergence,
    save_base,
    text_chunks,
)

NO_BOS = SimpleNamespace(bos_token_id=None)


def tiny_pair(seed: int = 0):
    """Two random llama-tiny models, the second the first with its weights moved a little: logits
    of a few nats' spread (the head scaled up), their distributions apart by a KLD of about 0.1."""
    torch.manual_seed(seed)
    base = flashformer.build("llama-tiny").eval()
    with torch.no_grad():
        base.lm_head.weight.mul_(8)
    other = copy.deepcopy(base)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn_like(parameter))
    return base, other


def write_random_base(path, ctx=16, vocab=33, chunks=3, seed=0):
    """A base file of random logits; returns (tokens, each chunk's logits)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (chunks, ctx), generator=g).numpy()
    logits = [4 * torch.randn(scored_rows(ctx), vocab, generator=g) for _ in range(chunks)]
    write_base_logits(path, ctx, vocab, tokens, logits)
    return tokens, logits


def test_the_file_has_llama_perplexitys_layout(tmp_path):
    """Header, tokens and rows at the offsets llama-perplexity reads them, parsed with struct."""
    ctx, vocab, chunks = 16, 33, 3  # an odd vocabulary: each row is padded by one uint16
    tokens, logits = write_random_base(tmp_path / "b.kld", ctx, vocab, chunks)
    data = (tmp_path / "b.kld").read_bytes()
    assert data[:8] == b"_logits_" and struct.unpack("<3i", data[8:20]) == (ctx, vocab, chunks)
    assert (
        list(struct.unpack(f"<{chunks * ctx}i", data[20 : 20 + 4 * chunks * ctx])) == tokens.ravel().tolist()
    )
    rows, width = ctx - 1 - ctx // 2, 2 * ((vocab + 1) // 2) + 4
    assert (rows, width) == (scored_rows(ctx), row_width(vocab)) == (7, 38)
    body = data[20 + 4 * chunks * ctx :]
    assert len(body) == chunks * rows * width * 2
    for c in range(chunks):
        for r in range(rows):
            row = body[(c * rows + r) * width * 2 : (c * rows + r + 1) * width * 2]
            scale, floor = struct.unpack("<2f", row[:8])
            levels = np.array(struct.unpack(f"<{vocab}H", row[8 : 8 + 2 * vocab]))
            exact = torch.log_softmax(logits[c][r].double(), -1).numpy()
            top = exact.max()
            assert scale == pytest.approx((top - max(exact.min(), top - 16)) / 65535, rel=1e-6)
            kept = exact > floor  # above the floor every level is within half a step
            assert np.abs(scale * levels[kept] + floor - exact[kept]).max() <= 0.51 * scale + 1e-6
            assert row[8 + 2 * vocab :] == b"\0\0"


def test_a_file_reads_back_what_was_written(tmp_path):
    tokens, logits = write_random_base(tmp_path / "b.kld", ctx=20, vocab=40, chunks=2)
    base = read_base_logits(tmp_path / "b.kld")
    assert (base.ctx, base.vocab, base.chunks) == (20, 40, 2)
    assert np.array_equal(base.tokens, tokens)
    for c in range(2):
        exact = torch.log_softmax(logits[c].double(), -1)  # (9, 40)
        read = base.log_probs(c)
        assert read.shape == (9, 40)
        top = exact.amax(-1, keepdim=True)
        kept = exact > top - 16  # within a level of the truth; further down, the floor 16 nats under the top
        assert (read - exact)[kept].abs().max() < 16 / 65535
        assert torch.allclose(read[~kept], (top - 16).expand_as(read)[~kept], atol=1e-4)
        assert (~kept).any() and kept.sum() > 100


def test_a_narrow_row_and_a_flat_row(tmp_path):
    """Logits wider than 16 nats keep the top 16 (the rest at the floor); equal logits have scale 0."""
    logits = torch.zeros(scored_rows(8), 5)
    logits[0] = torch.tensor([0.0, -10.0, -30.0, -40.0, 5.0])
    write_base_logits(tmp_path / "b.kld", 8, 5, np.zeros((1, 8), dtype=np.int32), [logits])
    read = read_base_logits(tmp_path / "b.kld").log_probs(0)
    exact = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(read[0, [0, 1, 4]], exact[0, [0, 1, 4]], atol=1e-3)
    assert (
        read[0, 2] == read[0, 3] == pytest.approx(exact[0, 4].item() - 16, abs=1e-3)
    )  # 16 nats under the top
    assert torch.allclose(read[1:], torch.full_like(read[1:], -math.log(5)), atol=1e-6)


def test_bad_files_are_named_with_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.kld does not exist"):
        read_base_logits(tmp_path / "missing.kld")
    (tmp_path / "text.kld").write_bytes(b"hello, this is not a logits file")
    with pytest.raises(ValueError, match="text.kld is not a base logits file"):
        read_base_logits(tmp_path / "text.kld")
    write_random_base(tmp_path / "b.kld")
    (tmp_path / "cut.kld").write_bytes((tmp_path / "b.kld").read_bytes()[:-2])
    with pytest.raises(ValueError, match="cut.kld has .* bytes; a file of 3 chunks of 16 tokens"):
        read_base_logits(tmp_path / "cut.kld")


def test_writing_stops_whole_or_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="1 chunks of logits given for 2 chunks"):
        write_base_logits(tmp_path / "b.kld", 8, 5, np.zeros((2, 8), dtype=np.int32), [torch.zeros(3, 5)])
    assert list(tmp_path.iterdir()) == []


def reference_statistics(base_model, model, tokens: np.ndarray) -> dict:
    """Per scored position, in float64 from both models' logits directly: the exact KL(P || Q), the
    next tokens' NLLs and whether the top tokens agree."""
    ctx, first = tokens.shape[1], tokens.shape[1] // 2
    figures = {"kld": [], "nll": [], "nll_base": [], "top": []}
    with torch.no_grad():
        for chunk in torch.from_numpy(tokens.astype(np.int64)):
            p = torch.log_softmax(base_model.double()(chunk[None]).logits[0, first : ctx - 1], -1)  # (R, V)
            q = torch.log_softmax(model.double()(chunk[None]).logits[0, first : ctx - 1], -1)  # (R, V)
            target = chunk[first + 1 :, None]
            figures["kld"].append((p.exp() * (p - q)).sum(-1))
            figures["nll"].append(-q.gather(-1, target)[:, 0])
            figures["nll_base"].append(-p.gather(-1, target)[:, 0])
            figures["top"].append(p.argmax(-1) == q.argmax(-1))
    base_model.float(), model.float()
    return {name: torch.cat(values).numpy() for name, values in figures.items()}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    base_model, model = tiny_pair()
    tokens = torch.randint(0, 1000, (5 * 32,), generator=torch.Generator().manual_seed(1)).tolist()
    tokenizer = SimpleNamespace(bos_token_id=None, encode=lambda text: tokens)
    path = tmp_path_factory.mktemp("kld") / "base.kld"
    saved = save_base(base_model, tokenizer, "the text", path, ctx=32)
    result = kl_divergence(model, tokenizer, read_base_logits(path))
    return base_model, model, saved, result, read_base_logits(path)


def test_kld_equals_float64_math_on_random_models(measured):
    base_model, model, saved, result, base = measured
    assert (saved.chunks, saved.tokens, result.chunks, result.tokens) == (5, 5 * 15, 5, 5 * 15)
    exact = reference_statistics(base_model, model, base.tokens)
    assert 0.02 < exact["kld"].mean() < 2  # the two models do differ
    # the base is read from 16 bits a token (steps under 16/65535 nats): the KLDs agree to that
    assert np.abs(result.kld - exact["kld"]).max() < 5e-4
    assert result.mean_kld == pytest.approx(exact["kld"].mean(), rel=2e-3)
    assert np.abs(result.nll - exact["nll"]).max() < 1e-4
    assert np.abs(result.nll_base - exact["nll_base"]).max() < 3e-4
    assert saved.nll == pytest.approx(exact["nll_base"].sum(), rel=1e-5)
    assert result.same_top == pytest.approx(exact["top"].mean())
    p_diff = np.exp(-exact["nll"]) - np.exp(-exact["nll_base"])
    assert result.rms_p_diff == pytest.approx(math.sqrt((p_diff**2).mean()), rel=1e-3)
    stats = result.stats
    assert stats["ppl"]["value"] == pytest.approx(math.exp(exact["nll"].mean()), rel=1e-5)
    assert stats["ppl_base"]["value"] == pytest.approx(math.exp(exact["nll_base"].mean()), rel=1e-4)
    correlation = np.corrcoef(exact["nll"], exact["nll_base"])[0, 1]
    assert stats["correlation"] == pytest.approx(correlation, abs=1e-3)
    n = len(exact["kld"])
    assert stats["kld"]["error"] == pytest.approx(exact["kld"].std() / math.sqrt(n - 1), rel=2e-3)


def test_percentiles_interpolate_between_sorted_values(measured):
    result = measured[3]
    values = np.sort(result.kld)
    points = result.percentiles("kld")
    assert list(points) == ["max", "99.9", "99", "95", "90", "median", "10", "5", "1", "0.1", "min"]
    assert (points["max"], points["min"]) == (values[-1], values[0])
    position = 0.9 * (len(values) - 1)  # between two sorted values, linearly
    low = int(position)
    expected = values[low] + (position - low) * (values[low + 1] - values[low])
    assert points["90"] == pytest.approx(expected, rel=1e-12)
    n = len(values)
    assert points["median"] == pytest.approx(
        values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    )
    assert list(result.percentiles("p_diff"))[5:8] == ["75", "median", "25"]


def test_the_same_model_is_no_distance_from_itself(measured):
    base_model, _, _, _, base = measured
    result = kl_divergence(base_model, NO_BOS, base)
    assert abs(result.mean_kld) < 1e-4 and result.same_top == 1.0
    assert result.stats["ln_ratio"]["value"] == pytest.approx(0, abs=1e-4)


def test_a_vocabulary_mismatch_names_the_file_and_both_sizes(tmp_path):
    write_random_base(tmp_path / "other.kld", ctx=16, vocab=999)
    model = flashformer.build("llama-tiny").eval()
    with pytest.raises(ValueError, match=r"other\.kld holds .* vocabulary of 999 tokens; the model has 1000"):
        kl_divergence(model, NO_BOS, read_base_logits(tmp_path / "other.kld"))


def test_another_programs_logits_file_measures_as_the_model_does(measured, tmp_path):
    """The model's log-probabilities saved as a base file of the same tokens (what llama-perplexity
    --kl-divergence-base writes of a quantized model), measured against the base file: the float64
    figures, up to the two files' 16-bit rounding, and the same as running the model."""
    base_model, model, _, result, base = measured
    save_base(model, NO_BOS, base.tokens, tmp_path / "other.kld")
    files = file_divergence(read_base_logits(tmp_path / "other.kld"), base)
    exact = reference_statistics(base_model, model, base.tokens)
    assert (files.chunks, files.tokens) == (5, 5 * 15)
    assert np.abs(files.kld - exact["kld"]).max() < 1e-3
    assert files.mean_kld == pytest.approx(exact["kld"].mean(), rel=3e-3)
    assert files.mean_kld == pytest.approx(result.mean_kld, rel=3e-3)
    assert np.abs(files.nll - exact["nll"]).max() < 3e-4
    assert files.same_top == pytest.approx(exact["top"].mean())
    itself = file_divergence(base, base)
    assert abs(itself.mean_kld) < 1e-9 and itself.same_top == 1.0


def test_a_logits_file_of_other_tokens_is_refused(measured, tmp_path):
    base = measured[4]
    tokens = base.tokens.copy()
    tokens[3, 5] = (tokens[3, 5] + 1) % base.vocab
    write_base_logits(tmp_path / "o.kld", base.ctx, base.vocab, tokens,
                      [torch.zeros(scored_rows(base.ctx), base.vocab)] * base.chunks)  # fmt: skip
    with pytest.raises(ValueError, match=r"o\.kld and .* hold different tokens from chunk 3 on"):
        file_divergence(read_base_logits(tmp_path / "o.kld"), base)
    write_random_base(tmp_path / "narrow.kld", ctx=16, vocab=999)
    with pytest.raises(ValueError, match=r"narrow\.kld has chunks of 16 tokens over a vocabulary of 999"):
        file_divergence(read_base_logits(tmp_path / "narrow.kld"), base)


def test_chunks_bos_and_the_logits_callable(measured):
    """Each chunk reaches the callable whole, its first token swapped for BOS where the tokenizer
    adds one; only the chunks asked for run; the file's tokens are left as the text gave them."""
    base_model, _, _, _, base = measured
    seen = []

    def recording(model, ids, keep):
        seen.append(ids.clone())
        return chunk_logits(model, ids, keep)

    with_bos = SimpleNamespace(bos_token_id=7, add_bos_token=True)
    result = kl_divergence(base_model, with_bos, base, chunks=2, logits=recording)
    assert result.chunks == 2 and result.tokens == 30 and len(seen) == 2
    for c, ids in enumerate(seen):
        assert ids[0] == 7 and torch.equal(ids[1:], torch.from_numpy(base.tokens[c, 1:].astype(np.int64)))
    assert base.tokens[0, 0] != 7


def test_bos_comes_from_the_tokenizer():
    assert bos_to_add(SimpleNamespace(bos_token_id=1, add_bos_token=True)) == 1
    assert bos_to_add(SimpleNamespace(bos_token_id=1, add_bos_token=False)) is None
    assert bos_to_add(NO_BOS) is None
    # a tokenizer that does not say: what its encode does
    assert bos_to_add(SimpleNamespace(bos_token_id=1, add_bos_token=None, encode=lambda t: [1, 5])) == 1
    assert bos_to_add(SimpleNamespace(bos_token_id=1, add_bos_token=None, encode=lambda t: [5])) is None


def test_text_chunks_follow_llama_perplexity():
    ids = list(range(100))
    assert text_chunks(ids, 32, None).shape == (3, 32)  # whole chunks only
    assert text_chunks(ids, 32, 2).tolist() == [list(range(32)), list(range(32, 64))]
    with pytest.raises(ValueError, match="the text has 100 tokens; a context of 64 needs at least 128"):
        text_chunks(ids, 64, None)


def test_a_chunk_through_a_cache_of_blocks_is_what_the_cache_stores():
    """cached_chunk_logits runs the scored half over a KV cache of the types asked for: in f32 it is
    the plain forward's logits (up to the order of float sums); in q8_0 / q4_0 it moves them, a little."""
    torch.manual_seed(0)
    model = flashformer.build("llama-tiny", d_model=128, n_heads=4, n_kv_heads=2).eval()  # heads of 32
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    plain = chunk_logits(model, ids, 11)
    floats = cached_chunk_logits("f32", "f32")(model, ids, 11)
    assert floats.shape == plain.shape and torch.allclose(floats, plain, atol=1e-5, rtol=1e-5)
    blocks = cached_chunk_logits("q8_0", "q4_0")(model, ids, 11)
    kld = torch.nn.functional.kl_div(
        blocks.log_softmax(-1), plain.log_softmax(-1), log_target=True, reduction="none"
    )
    assert not torch.equal(blocks, floats) and 0 < float(kld.sum(-1).mean()) < 0.05
