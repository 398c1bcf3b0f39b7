"""bench quality's text and its table: the validation files of the default corpus, the
perplexity changes against float32 and the ratio to llama.cpp read off the stored results."""

from __future__ import annotations

from flashformer.bench import quality
from flashformer.train.config import TrainConfig
from flashformer.train.corpus import resolve_corpus, split_documents


def test_the_text_is_validation_files_only():
    names, texts = quality.validation_texts(3)
    train, _ = split_documents(resolve_corpus(None), TrainConfig.val_fraction)
    assert len(names) == len(texts) == 3 and names == sorted(names)
    assert not set(names) & {d.name for d in train} and all(texts)


def test_table_and_plot_from_a_payload(tmp_path):
    def result(ppl):
        return {"perplexity": ppl, "bits_per_byte": 0.5, "tokens": 100, "context": 512, "stride": 256}

    payload = {
        "texts": ["a.py", "b.py"],
        "context": 512,
        "stride": 256,
        "models": {
            "m.gguf": {
                "float32": result(8.0),
                "int8": result(8.04),
                "gguf blocks, int8 activations": result(8.1),
                "llama.cpp (the file's blocks, 8-bit activations)": result(8.0),
            }
        },
    }
    text = quality.table(payload)
    assert "| m.gguf | int8 | 8.0400 | +0.50 % | 0.5000 | 100 |" in text
    assert "m.gguf: context 512, stride 256." in text
    assert "m.gguf: flashformer on the file's blocks / llama.cpp = 1.0125" in text
    quality.plot(payload, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0
