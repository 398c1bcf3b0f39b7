"""The synthetic long-range tasks: every answer is the token its stated distance back (checked by
reading the sequence, not by the generator's bookkeeping), examples are functions of their seed,
and accuracy counts only the answers, by octave of distance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashformer.train import synthetic


@pytest.mark.parametrize("task", synthetic.TASKS)
@pytest.mark.parametrize("seq_len", [32, 128])
def test_every_answer_is_the_token_its_distance_back(task, seq_len):
    for index in range(20):
        e = synthetic.example(task, seq_len, seed=3, split=0, index=index)
        assert e.tokens.shape == (seq_len + 1,) and e.answer.any() and not e.answer[0]
        assert e.tokens.max() < synthetic.VOCAB_SIZE
        for t in np.flatnonzero(e.answer):
            d = int(e.distance[t])
            assert 1 <= d <= t and e.tokens[t] == e.tokens[t - d], (task, index, t, d)
            assert e.tokens[t - d] >= synthetic.FIRST_DATA  # a data token, never a blank
            if task == "recall":  # the query key is the one before the value, seen last d tokens back
                key = e.tokens[t - 1]
                assert e.tokens[t - 1 - d] == key and key not in e.tokens[t - d + 1 : t - 1 : 2]


def test_recall_keys_are_distinct_and_distances_span_octaves():
    e = synthetic.example("recall", 128, seed=0, split=0, index=0)
    keys = e.tokens[0:64:2]
    assert len(set(keys.tolist())) == 32 and all(
        synthetic.FIRST_DATA <= k < synthetic.FIRST_DATA + 64 for k in keys
    )
    distances = np.concatenate([synthetic.example("recall", 128, 0, 0, i).distance for i in range(50)])
    octaves = {synthetic.distance_bucket(int(d)) for d in distances[distances > 0]}
    assert octaves >= {1, 2, 3, 4, 5, 6}  # 2-3 ... 64-127


def test_selective_copying_outputs_the_data_in_order_without_blanks():
    e = synthetic.example("selective-copying", 64, seed=1, split=0, index=5)
    region = e.tokens[: 64 - 4]
    data = region[region != synthetic.BLANK]
    assert e.tokens[60] == synthetic.SEPARATOR and (e.tokens[61:65] == data).all() and e.answer[61:65].all()


def test_examples_are_functions_of_seed_split_and_index():
    a = synthetic.batch("copying", 64, seed=0, split=0, indices=[4, 7])
    b = synthetic.batch("copying", 64, seed=0, split=0, indices=[4, 7])
    val = synthetic.batch("copying", 64, seed=0, split=1, indices=[4, 7])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["input_ids"], val["input_ids"])
    # targets: the next token at answers only
    answers = a["targets"] != synthetic.IGNORE
    full = torch.cat([a["input_ids"][:, 1:], a["targets"][:, -1:]], dim=1)
    assert torch.equal(a["targets"][answers], full[answers])


def test_accuracy_counts_answers_only_by_octave():
    targets = torch.tensor([[synthetic.IGNORE, 5, 6, synthetic.IGNORE, 7]])
    distance = torch.tensor([[0, 2, 3, 0, 9]])
    predictions = torch.tensor([[0, 5, 0, 1, 7]])  # right, wrong, right at the answers
    scores = synthetic.accuracy_by_distance(predictions, targets, distance)
    assert scores["accuracy"] == pytest.approx(2 / 3)
    assert scores["by_distance"] == {"2-3": 0.5, "8-15": 1.0} and scores["counts"] == {"2-3": 2, "8-15": 1}


def test_unknown_task_and_too_long_recall_are_refused():
    with pytest.raises(ValueError, match="unknown task 'sorting'"):
        synthetic.example("sorting", 32, 0, 0, 0)
    with pytest.raises(ValueError, match="seq_len=512 gives 128 pairs"):
        synthetic.example("recall", 512, 0, 0, 0)
