"""Task metrics against hand-worked values and against separate, brute-force references."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flashformer.encoders import metrics

# ---- classification ----


def test_accuracy_and_macro_f1_by_hand():
    gold = ["a", "a", "b", "c"]
    predicted = ["a", "b", "b", "b"]
    assert metrics.accuracy(gold, predicted) == 0.5
    scores = metrics.per_class_scores(gold, predicted)
    # a: tp 1, fp 0, fn 1 -> P 1, R 1/2, F1 2/3; b: tp 1, fp 2, fn 0 -> P 1/3, R 1, F1 1/2; c: never predicted
    assert scores["a"] == pytest.approx({"precision": 1.0, "recall": 0.5, "f1": 2 / 3, "support": 2})
    assert scores["b"] == pytest.approx({"precision": 1 / 3, "recall": 1.0, "f1": 0.5, "support": 1})
    assert scores["c"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert metrics.macro_f1(gold, predicted) == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
    # a listed class with no gold and no prediction counts as F1 0 (scikit-learn, zero_division=0)
    assert metrics.macro_f1(gold, predicted, labels=["a", "b", "c", "d"]) == pytest.approx(
        (2 / 3 + 1 / 2) / 4
    )
    assert metrics.macro_f1([0, 1, 1], np.array([0, 1, 1])) == 1.0
    assert metrics.accuracy(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0])) == pytest.approx(2 / 3)


def reference_macro_f1(gold, predicted, labels):
    """Straight from the definitions: P and R per class, F1 = 2PR / (P + R), 0 where undefined."""
    total = 0.0
    for label in labels:
        tp = sum(1 for g, p in zip(gold, predicted) if g == label and p == label)
        predicted_count = sum(1 for p in predicted if p == label)
        gold_count = sum(1 for g in gold if g == label)
        precision = tp / predicted_count if predicted_count else 0.0
        recall = tp / gold_count if gold_count else 0.0
        total += 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return total / len(labels)


def test_macro_f1_matches_a_separate_computation_on_random_labels():
    rng = random.Random(0)
    for _ in range(200):
        n, classes = rng.randint(1, 30), rng.randint(1, 6)
        gold = [rng.randrange(classes) for _ in range(n)]
        predicted = [g if rng.random() < 0.5 else rng.randrange(classes + 1) for g in gold]
        seen = sorted(set(gold) | set(predicted))
        assert metrics.macro_f1(gold, predicted) == pytest.approx(reference_macro_f1(gold, predicted, seen))
        listed = list(range(classes + 2))
        assert metrics.macro_f1(gold, predicted, listed) == pytest.approx(
            reference_macro_f1(gold, predicted, listed)
        )


def test_majority_baseline():
    assert metrics.majority_label(["b", "a", "b", "a", "c"]) == "a"  # a tie goes to the label sorting first
    baseline = metrics.majority_baseline(["x", "y", "y"], gold=["y", "x", "z", "y"])
    assert baseline["label"] == "y" and baseline["accuracy"] == 0.5
    # y: P 2/4, R 1 -> F1 2/3; x and z never predicted -> 0
    assert baseline["macro_f1"] == pytest.approx((2 / 3) / 3)


def test_multilabel_scores_by_hand():
    gold = [{"a", "b"}, {"c"}, set()]
    predicted = [("a",), ["c", "b"], []]
    scores = metrics.multilabel_scores(gold, predicted)
    # a: tp 1; b: fp 1, fn 1; c: tp 1 -> micro 2*2 / (2*2 + 1 + 1); macro (1 + 0 + 1) / 3
    assert scores == pytest.approx({"micro_f1": 4 / 6, "macro_f1": 2 / 3, "exact_match": 1 / 3})
    with pytest.raises(ValueError, match=r"gold\[0\] holds \['b'\], not among the labels"):
        metrics.multilabel_scores(gold, predicted, labels=["a", "c"])
    with pytest.raises(TypeError, match=r"gold\[0\] is 'a'"):
        metrics.multilabel_scores(["a"], [["a"]])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: metrics.accuracy([], []), ValueError, "gold is empty"),
        (lambda: metrics.accuracy([1, 2], [1]), ValueError, "gold has 2 values but predicted has 1"),
        (
            lambda: metrics.accuracy(np.zeros((2, 2)), [1, 2]),
            ValueError,
            r"gold must be 1-D .* shape \(2, 2\)",
        ),
        (lambda: metrics.accuracy("ab", "ab"), TypeError, "gold must be a sequence of labels"),
        (
            lambda: metrics.macro_f1([1], [2], labels=[1]),
            ValueError,
            r"predicted\[0\] is 2, which is not among",
        ),
        (lambda: metrics.macro_f1([1], ["1"]), TypeError, "mix label types"),
        (lambda: metrics.majority_label([]), ValueError, "train_labels is empty"),
    ],
)
def test_classification_metrics_name_the_bad_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---- tagging ----


def test_token_scores_by_hand():
    gold = [["B-PER", "I-PER", "O"], ["O", "B-LOC"]]
    predicted = [["B-PER", "O", "O"], ["B-LOC", "B-LOC"]]
    scores = metrics.token_scores(gold, predicted)
    # 3 of 5 tokens right; positives (not O): gold 3, predicted 3, right 2
    assert scores["accuracy"] == pytest.approx(3 / 5)
    assert scores["precision"] == pytest.approx(2 / 3) and scores["recall"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx(2 / 3)
    # B-PER: F1 1; I-PER: missed, F1 0; B-LOC: tp 1, fp 1 -> F1 2/3
    assert scores["macro_f1"] == pytest.approx((1 + 0 + 2 / 3) / 3)
    plain = metrics.token_scores([["NAME", "OP", "NAME"]], [["NAME", "NAME", "NAME"]], outside=None)
    assert plain["precision"] == plain["recall"] == plain["f1"] == plain["accuracy"] == pytest.approx(2 / 3)


def test_entity_spans_follow_conlleval_chunking():
    tags = ["B-PER", "I-PER", "O", "I-LOC", "I-LOC", "B-LOC", "I-PER", "B-ORG", "I-ORG"]
    assert metrics.entity_spans(tags) == [
        ("PER", 0, 2),
        ("LOC", 3, 5),
        ("LOC", 5, 6),
        ("PER", 6, 7),
        ("ORG", 7, 9),
    ]
    assert metrics.entity_spans(["I-X", "B-X", "I-X", "I-Y"]) == [("X", 0, 1), ("X", 1, 3), ("Y", 3, 4)]
    assert metrics.entity_spans(["O", "O"]) == []
    assert metrics.entity_spans(["OP", "OP", "NAME", "O", "NAME"], scheme="io") == [
        ("OP", 0, 2),
        ("NAME", 2, 3),
        ("NAME", 4, 5),
    ]
    with pytest.raises(ValueError, match=r"tags\[1\] is 'PER'; expected O, B-TYPE or I-TYPE"):
        metrics.entity_spans(["O", "PER"])
    with pytest.raises(ValueError, match="scheme must be"):
        metrics.entity_spans(["O"], scheme="bioes")


def test_entity_scores_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    predicted = [["B-PER", "I-PER", "O", "B-PER"], ["B-ORG", "I-ORG"]]
    # gold: PER(0,2) LOC(3,4) ORG(0,1); predicted: PER(0,2) PER(3,4) ORG(0,2): only PER(0,2) right
    scores = metrics.entity_scores(gold, predicted)
    assert scores["precision"] == pytest.approx(1 / 3) and scores["recall"] == pytest.approx(1 / 3)
    assert scores["f1"] == pytest.approx(1 / 3)
    assert scores["per_type"]["PER"] == pytest.approx(
        {"precision": 0.5, "recall": 1.0, "f1": 2 / 3, "support": 1}
    )
    assert scores["per_type"]["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    nothing = metrics.entity_scores([["B-X"]], [["O"]])
    assert (nothing["precision"], nothing["recall"], nothing["f1"]) == (0.0, 0.0, 0.0)


def brute_force_entities(tags: list[str]) -> set[tuple[str, int, int]]:
    """Every span (start, end) tested against what an entity is, rather than scanned for:
    it begins where a chunk may begin (B-X, or an I-X not continuing an X), every tag inside
    is I-X, and the tag after it does not continue it."""

    def kind(tag):
        return ("O", None) if tag == "O" else (tag[0], tag[2:])

    entities = set()
    for start in range(len(tags)):
        prefix, entity_type = kind(tags[start])
        previous_type = kind(tags[start - 1])[1] if start else None
        if prefix == "O" or (prefix == "I" and previous_type == entity_type):
            continue
        for end in range(start + 1, len(tags) + 1):
            inside = all(kind(tag) == ("I", entity_type) for tag in tags[start + 1 : end])
            closed = end == len(tags) or kind(tags[end]) != ("I", entity_type)
            if inside and closed:
                entities.add((entity_type, start, end))
    return entities


def test_entity_scores_match_a_brute_force_reference():
    rng = random.Random(0)
    vocabulary = ["O", "B-A", "I-A", "B-B", "I-B"]
    for _ in range(300):
        gold, predicted = [], []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 9)
            gold_tags = [rng.choice(vocabulary) for _ in range(n)]
            gold.append(gold_tags)
            predicted.append([t if rng.random() < 0.6 else rng.choice(vocabulary) for t in gold_tags])
        for tags in gold:
            assert set(metrics.entity_spans(tags)) == brute_force_entities(tags)
        gold_set = {(i, *e) for i, tags in enumerate(gold) for e in brute_force_entities(tags)}
        predicted_set = {(i, *e) for i, tags in enumerate(predicted) for e in brute_force_entities(tags)}
        correct = len(gold_set & predicted_set)
        precision = correct / len(predicted_set) if predicted_set else 0.0
        recall = correct / len(gold_set) if gold_set else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        scores = metrics.entity_scores(gold, predicted)
        assert (scores["precision"], scores["recall"], scores["f1"]) == pytest.approx((precision, recall, f1))


def test_tagging_metrics_name_the_bad_argument():
    with pytest.raises(ValueError, match=r"gold\[1\] has 2 tags but predicted\[1\] has 1"):
        metrics.token_scores([["O"], ["O", "O"]], [["O"], ["O"]])
    with pytest.raises(ValueError, match="gold has 1 values but predicted has 2"):
        metrics.entity_scores([["O"]], [["O"], ["O"]])
    with pytest.raises(ValueError, match="gold holds no tokens"):
        metrics.token_scores([[]], [[]])
    with pytest.raises(ValueError, match=r"predicted\[0\]\[1\] is 'X'"):
        metrics.entity_scores([["O", "O"]], [["O", "X"]])


# ---- retrieval ----


def reference_ranks(scores: np.ndarray, relevant: list[list[int]]) -> list[list[int]]:
    """Ranks read off a full sort: score descending, then non-relevant before relevant
    (the pessimistic rule), then index."""
    ranks = []
    for row, ids in zip(scores, relevant):
        order = sorted(range(len(row)), key=lambda j: (-row[j], j in ids, j))
        ranks.append([order.index(d) + 1 for d in ids])
    return ranks


def test_paired_retrieval_by_hand():
    scores = np.array(
        [
            [0.9, 0.1, 0.0],  # query 0: its document first
            [0.8, 0.5, 0.2],  # query 1: its document second
            [0.3, 0.3, 0.3],  # query 2: all tied -> pessimistic rank 3
        ]
    )
    result = metrics.paired_retrieval_scores(scores)
    assert result == pytest.approx({"mrr@10": (1 + 1 / 2 + 1 / 3) / 3, "recall@1": 1 / 3, "recall@10": 1.0})
    assert metrics.paired_retrieval_scores(scores, mrr_at=2, recall_at=(2,)) == pytest.approx(
        {"mrr@2": (1 + 1 / 2) / 3, "recall@2": 2 / 3}
    )
    # collapsed embeddings (every score equal) rank every relevant document last
    constant = metrics.paired_retrieval_scores(np.ones((20, 20)))
    assert constant == {"mrr@10": 0.0, "recall@1": 0.0, "recall@10": 0.0}
    # documents beyond the queries are distractors
    wide = metrics.paired_retrieval_scores(np.array([[0.5, 0.9]]))
    assert wide == pytest.approx({"mrr@10": 0.5, "recall@1": 0.0, "recall@10": 1.0})


def test_retrieval_with_explicit_relevant_ids_by_hand():
    scores = np.array([[1.0, 1.0, 0.5, 2.0]])
    # document 3 (not relevant) is above both; 0 and 1 tie: 0 ranks 2, 1 ranks 3
    assert [r.tolist() for r in metrics.relevant_ranks(scores, [[0, 1]])] == [[2, 3]]
    result = metrics.retrieval_scores(scores, [[0, 1]], recall_at=(1, 2, 3))
    assert result == pytest.approx({"mrr@10": 0.5, "recall@1": 0.0, "recall@2": 0.5, "recall@3": 1.0})
    assert metrics.retrieval_scores(scores, [3]) == {"mrr@10": 1.0, "recall@1": 1.0, "recall@10": 1.0}


def test_retrieval_ranks_match_a_full_sort():
    rng = np.random.default_rng(0)
    for _ in range(100):
        queries, documents = rng.integers(1, 6), rng.integers(1, 15)
        scores = rng.integers(0, 4, size=(queries, documents)).astype(float)  # many ties
        relevant = [
            sorted(rng.choice(documents, size=rng.integers(1, documents + 1), replace=False).tolist())
            for _ in range(queries)
        ]
        got = [r.tolist() for r in metrics.relevant_ranks(scores, relevant)]
        assert got == reference_ranks(scores, relevant)
        expected_mrr = np.mean([1 / min(r) if min(r) <= 10 else 0 for r in reference_ranks(scores, relevant)])
        expected_recall = np.mean([np.mean([x <= 3 for x in r]) for r in reference_ranks(scores, relevant)])
        result = metrics.retrieval_scores(scores, relevant, recall_at=(3,))
        assert result == pytest.approx({"mrr@10": expected_mrr, "recall@3": expected_recall})


def test_retrieval_takes_torch_scores_in_bfloat16():
    scores = torch.eye(4, dtype=torch.bfloat16) + 0.25
    assert metrics.paired_retrieval_scores(scores) == {"mrr@10": 1.0, "recall@1": 1.0, "recall@10": 1.0}


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: metrics.paired_retrieval_scores(np.zeros(3)),
            ValueError,
            r"scores must be 2-D .* shape \(3,\)",
        ),
        (lambda: metrics.paired_retrieval_scores(np.zeros((0, 3))), ValueError, "scores is empty"),
        (lambda: metrics.paired_retrieval_scores(np.zeros((3, 2))), ValueError, "3 queries but 2 documents"),
        (
            lambda: metrics.paired_retrieval_scores(np.array([[0.0, np.nan]])),
            ValueError,
            "1 non-finite values .* query 0, document 1",
        ),
        (
            lambda: metrics.retrieval_scores(np.zeros((2, 3)), [0]),
            ValueError,
            "relevant has 1 entries but scores has 2",
        ),
        (
            lambda: metrics.retrieval_scores(np.zeros((1, 3)), [[3]]),
            ValueError,
            r"relevant\[0\] holds document 3",
        ),
        (lambda: metrics.retrieval_scores(np.zeros((1, 3)), [[]]), ValueError, r"relevant\[0\] is empty"),
        (lambda: metrics.retrieval_scores(np.zeros((1, 3)), [[1, 1]]), ValueError, "repeats a document id"),
        (
            lambda: metrics.retrieval_scores(np.zeros((1, 3)), [[0.5]]),
            TypeError,
            "expected integer document ids",
        ),
        (lambda: metrics.paired_retrieval_scores(np.zeros((1, 1)), mrr_at=0), ValueError, "mrr_at must hold"),
    ],
)
def test_retrieval_metrics_name_the_bad_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
