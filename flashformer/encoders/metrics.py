"""The metrics that judge a fine-tuned encoder: pure functions of gold and predicted values.

    classification   accuracy, per_class_scores, macro_f1, majority_baseline, multilabel_scores
    tagging          token_scores (per token), entity_spans / entity_scores (per BIO span)
    retrieval        retrieval_scores (explicit relevant ids), paired_retrieval_scores (query i
                     finds document i): MRR@10, recall@1, recall@10

Conventions, where libraries differ:
- A ratio with a zero denominator is 0 (scikit-learn's zero_division=0): a class never
  predicted has precision 0, a class never in gold recall 0, and F1 is 0 when both are 0.
- Entities are chunked as seqeval (and conlleval) do in their default mode; a predicted
  entity counts only when its type and its exact span match a gold one.
- Ranks are pessimistic: a document scored the same as a relevant one ranks above it, so a
  model whose scores collapsed to a constant gets the worst rank, never a lucky first.

Inputs may be lists, numpy arrays or torch tensors; every function checks them and names
the argument it rejects.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def _f1(true_positives: int, false_positives: int, false_negatives: int) -> float:
    """2PR / (P + R), written as 2tp / (2tp + fp + fn): the same where both are defined, and 0
    (not NaN) for a class with no gold and no predicted example."""
    return _ratio(2 * true_positives, 2 * true_positives + false_positives + false_negatives)


def _as_list(values, name: str) -> list:
    """A 1-D sequence as a list (numpy arrays and torch tensors included)."""
    if hasattr(values, "detach"):  # a torch tensor, without importing torch
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(
                f"{name} must be 1-D (one value per example); got an array of shape {values.shape}"
            )
        return values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a sequence of labels (list, tuple, array); got {type(values).__name__}"
        )
    return list(values)


def _paired(gold, predicted, gold_name: str = "gold", predicted_name: str = "predicted") -> tuple[list, list]:
    gold, predicted = _as_list(gold, gold_name), _as_list(predicted, predicted_name)
    if not gold:
        raise ValueError(f"{gold_name} is empty; expected at least one example")
    if len(gold) != len(predicted):
        raise ValueError(
            f"{gold_name} has {len(gold)} values but {predicted_name} has {len(predicted)}; "
            "expected one prediction per gold value"
        )
    return gold, predicted


# ---- classification ----


def accuracy(gold, predicted) -> float:
    """The fraction of examples whose predicted label equals the gold label."""
    gold, predicted = _paired(gold, predicted)
    return sum(g == p for g, p in zip(gold, predicted)) / len(gold)


def _sorted_union(*collections) -> list:
    union = set().union(*collections)
    try:
        return sorted(union)
    except TypeError:
        raise TypeError(
            f"gold and predicted mix label types ({sorted({type(v).__name__ for v in union})}); "
            "expected labels of one type, as ids or as names"
        ) from None


def _classes(gold: list, predicted: list, labels, what: str = "labels") -> list:
    """The classes to average over: `labels` when given (every gold and predicted value must be
    one of them), else the sorted union of the gold and predicted values."""
    if labels is None:
        return _sorted_union(gold, predicted)
    labels = _as_list(labels, "labels")
    if not labels:
        raise ValueError("labels is empty; pass None to use the labels found in gold and predicted")
    allowed = set(labels)
    for name, values in (("gold", gold), ("predicted", predicted)):
        for index, value in enumerate(values):
            if value not in allowed:
                raise ValueError(f"{name}[{index}] is {value!r}, which is not among the {what} {labels}")
    return labels


def per_class_scores(gold, predicted, labels=None) -> dict:
    """label -> {"precision", "recall", "f1", "support"} (support: the gold count).

    precision = tp / (tp + fp), recall = tp / (tp + fn), f1 = 2tp / (2tp + fp + fn), each 0
    when its denominator is 0. labels: the classes to report (default: those in gold or
    predicted); a listed class with no gold and no predicted example gets 0 throughout.
    """
    gold, predicted = _paired(gold, predicted)
    classes = _classes(gold, predicted, labels)
    true_positives = Counter(g for g, p in zip(gold, predicted) if g == p)
    gold_counts, predicted_counts = Counter(gold), Counter(predicted)
    scores = {}
    for label in classes:
        tp = true_positives[label]
        fp, fn = predicted_counts[label] - tp, gold_counts[label] - tp
        scores[label] = {
            "precision": _ratio(tp, tp + fp),
            "recall": _ratio(tp, tp + fn),
            "f1": _f1(tp, fp, fn),
            "support": gold_counts[label],
        }
    return scores


def macro_f1(gold, predicted, labels=None) -> float:
    """The unweighted mean of the per-class F1 (per_class_scores): each class counts the same
    however rare, so a model that ignores a small class is seen to.

    Over `labels` when given, as scikit-learn's f1_score(average="macro", labels=...,
    zero_division=0): a listed class absent from both gold and predicted adds an F1 of 0.
    With labels=None, over the classes present in gold or predicted.
    """
    scores = per_class_scores(gold, predicted, labels)
    return sum(s["f1"] for s in scores.values()) / len(scores)


def majority_label(train_labels):
    """The most frequent training label; a tie goes to the label that sorts first."""
    train_labels = _as_list(train_labels, "train_labels")
    if not train_labels:
        raise ValueError("train_labels is empty; expected the training set's labels")
    counts = Counter(train_labels)
    return min(counts, key=lambda label: (-counts[label], label))


def majority_baseline(train_labels, gold, labels=None) -> dict:
    """{"label", "accuracy", "macro_f1"} of always predicting the majority training label:
    the floor that a fine-tuned model's score means something above."""
    label = majority_label(train_labels)
    gold = _as_list(gold, "gold")
    predicted = [label] * len(gold)
    return {
        "label": label,
        "accuracy": accuracy(gold, predicted),
        "macro_f1": macro_f1(gold, predicted, labels),
    }


def multilabel_scores(gold, predicted, labels=None) -> dict:
    """{"micro_f1", "macro_f1", "exact_match"} for examples that each hold a set of labels.

    gold, predicted: per example a collection (set, list, tuple) of labels. micro F1 pools
    the (example, label) decisions of all labels; macro F1 averages each label's F1 (over
    `labels`, or the labels found in gold or predicted); exact_match is the fraction of
    examples whose predicted set equals the gold set.
    """
    gold, predicted = _paired(gold, predicted)
    gold_sets, predicted_sets = [], []
    for name, values, sets in (("gold", gold, gold_sets), ("predicted", predicted, predicted_sets)):
        for index, value in enumerate(values):
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError(
                    f"{name}[{index}] is {value!r}; expected a collection of labels (a multi-label example)"
                )
            sets.append(set(value))
    if labels is None:
        classes = _sorted_union(*gold_sets, *predicted_sets)
    else:
        classes = _as_list(labels, "labels")
        for name, sets in (("gold", gold_sets), ("predicted", predicted_sets)):
            for index, value in enumerate(sets):
                if not value <= set(classes):
                    raise ValueError(
                        f"{name}[{index}] holds {sorted(value - set(classes))}, not among the labels {classes}"
                    )
    counts = {label: [0, 0, 0] for label in classes}  # tp, fp, fn
    for gold_set, predicted_set in zip(gold_sets, predicted_sets):
        for label in gold_set & predicted_set:
            counts[label][0] += 1
        for label in predicted_set - gold_set:
            counts[label][1] += 1
        for label in gold_set - predicted_set:
            counts[label][2] += 1
    totals = [sum(c[i] for c in counts.values()) for i in range(3)]
    return {
        "micro_f1": _f1(*totals),
        "macro_f1": _ratio(sum(_f1(*c) for c in counts.values()), len(counts)),
        "exact_match": sum(g == p for g, p in zip(gold_sets, predicted_sets)) / len(gold_sets),
    }


# ---- tagging ----


def _paired_sequences(gold, predicted) -> tuple[list[list], list[list]]:
    """Gold and predicted tag sequences, checked to match in number and in each length."""
    gold, predicted = _paired(gold, predicted, "gold", "predicted")
    gold = [_as_list(tags, f"gold[{i}]") for i, tags in enumerate(gold)]
    predicted = [_as_list(tags, f"predicted[{i}]") for i, tags in enumerate(predicted)]
    for index, (gold_tags, predicted_tags) in enumerate(zip(gold, predicted)):
        if len(gold_tags) != len(predicted_tags):
            raise ValueError(
                f"gold[{index}] has {len(gold_tags)} tags but predicted[{index}] has {len(predicted_tags)}; "
                "expected one predicted tag per token"
            )
    if not any(gold):
        raise ValueError("gold holds no tokens; expected at least one tagged token")
    return gold, predicted


def token_scores(gold, predicted, outside: str | None = "O") -> dict:
    """{"accuracy", "precision", "recall", "f1", "macro_f1"} over the tokens of all sequences.

    gold, predicted: sequences of tag sequences. accuracy: tokens whose tag is right.
    precision / recall / f1 (micro): a token is a positive when its tag is not `outside`;
    a true positive when the predicted tag equals the gold one. macro_f1: the mean F1 of the
    tags other than `outside` found in gold or predicted. With no `outside` tag in use
    (every token a positive, as in the stdlib tagging task) precision, recall and f1
    equal accuracy. BIO tags are compared whole (B-PER and I-PER differ).
    """
    gold, predicted = _paired_sequences(gold, predicted)
    gold_tags = [tag for tags in gold for tag in tags]
    predicted_tags = [tag for tags in predicted for tag in tags]
    correct = sum(g == p for g, p in zip(gold_tags, predicted_tags))
    true_positives = sum(g == p != outside for g, p in zip(gold_tags, predicted_tags))
    gold_positives = sum(g != outside for g in gold_tags)
    predicted_positives = sum(p != outside for p in predicted_tags)
    tags = sorted((set(gold_tags) | set(predicted_tags)) - {outside})
    per_tag = per_class_scores(gold_tags, predicted_tags, tags + ([outside] if outside is not None else []))
    return {
        "accuracy": correct / len(gold_tags),
        "precision": _ratio(true_positives, predicted_positives),
        "recall": _ratio(true_positives, gold_positives),
        "f1": _f1(true_positives, predicted_positives - true_positives, gold_positives - true_positives),
        "macro_f1": _ratio(sum(per_tag[tag]["f1"] for tag in tags), len(tags)),
    }


def entity_spans(tags, scheme: str = "bio", name: str = "tags") -> list[tuple[str, int, int]]:
    """The entities of one tag sequence as (type, start, end), end exclusive.

    scheme "bio" (tags O, B-TYPE, I-TYPE), chunked as seqeval's default mode and conlleval:
    an entity starts at B-X, or at an I-X that does not continue an X entity (after O, at
    the start, or after another type); it continues over I-X and ends before O, any B-, or
    another type. scheme "io" (plain tags, O outside): an entity is a maximal run of one tag.
    """
    tags = _as_list(tags, name)
    if scheme not in ("bio", "io"):
        raise ValueError(f"scheme must be 'bio' or 'io'; got {scheme!r}")
    spans = []
    current_type, start = None, 0
    for position, tag in enumerate(tags):
        if not isinstance(tag, str):
            raise TypeError(f"{name}[{position}] is {tag!r}; expected a tag string")
        if tag == "O":
            entity_type, begins = None, False
        elif scheme == "io":
            entity_type, begins = tag, tag != current_type
        elif tag[:2] in ("B-", "I-") and len(tag) > 2:
            entity_type = tag[2:]
            begins = tag[0] == "B" or entity_type != current_type
        else:
            raise ValueError(f"{name}[{position}] is {tag!r}; expected O, B-TYPE or I-TYPE (scheme 'bio')")
        if current_type is not None and (entity_type is None or begins):
            spans.append((current_type, start, position))
            current_type = None
        if begins:
            current_type, start = entity_type, position
    if current_type is not None:
        spans.append((current_type, start, len(tags)))
    return spans


def entity_scores(gold, predicted, scheme: str = "bio") -> dict:
    """{"precision", "recall", "f1", "per_type"} over entities (entity_spans), pooled over all
    sequences (micro), as seqeval reports them.

    A predicted entity is correct only if a gold entity has its type, start and end;
    precision = correct / predicted entities, recall = correct / gold entities, each 0 when
    there are none. per_type: type -> {"precision", "recall", "f1", "support"}.
    """
    gold, predicted = _paired_sequences(gold, predicted)
    gold_entities, predicted_entities = set(), set()
    for index, (gold_tags, predicted_tags) in enumerate(zip(gold, predicted)):
        gold_entities |= {(index, *span) for span in entity_spans(gold_tags, scheme, f"gold[{index}]")}
        predicted_entities |= {
            (index, *span) for span in entity_spans(predicted_tags, scheme, f"predicted[{index}]")
        }
    correct = gold_entities & predicted_entities

    def scores(correct_count: int, predicted_count: int, gold_count: int) -> dict:
        fp, fn = predicted_count - correct_count, gold_count - correct_count
        return {
            "precision": _ratio(correct_count, predicted_count),
            "recall": _ratio(correct_count, gold_count),
            "f1": _f1(correct_count, fp, fn),
            "support": gold_count,
        }

    def count_by_type(entities):
        return Counter(entity[1] for entity in entities)

    correct_by_type = count_by_type(correct)
    predicted_by_type, gold_by_type = count_by_type(predicted_entities), count_by_type(gold_entities)
    overall = scores(len(correct), len(predicted_entities), len(gold_entities))
    del overall["support"]
    overall["per_type"] = {
        entity_type: scores(
            correct_by_type[entity_type], predicted_by_type[entity_type], gold_by_type[entity_type]
        )
        for entity_type in sorted(set(gold_by_type) | set(predicted_by_type))
    }
    return overall


# ---- retrieval ----


def _score_matrix(scores) -> np.ndarray:
    if hasattr(scores, "detach"):  # a torch tensor (bfloat16 included), without importing torch
        scores = scores.detach().float().cpu().numpy()
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D (queries, documents); got shape {scores.shape}")
    if scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(
            f"scores is empty (shape {scores.shape}); expected at least one query and one document"
        )
    if not np.isfinite(scores).all():
        bad = np.argwhere(~np.isfinite(scores))
        raise ValueError(
            f"scores holds {len(bad)} non-finite values (the first at query {bad[0][0]}, "
            f"document {bad[0][1]}); expected finite scores"
        )
    return scores


def _cutoffs(mrr_at: int, recall_at) -> tuple[int, tuple[int, ...]]:
    recall_at = tuple(recall_at)
    for name, value in [("mrr_at", mrr_at)] + [("recall_at", k) for k in recall_at]:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must hold positive integers; got {value!r}")
    return int(mrr_at), recall_at


def relevant_ranks(scores, relevant) -> list[np.ndarray]:
    """Per query, the 1-based ranks of its relevant documents (in the order given).

    The documents are ordered by score, highest first; among equal scores every
    non-relevant document goes before the relevant ones (the pessimistic rule) and relevant
    ones follow their index. So the rank of relevant document d is 1 + the non-relevant
    documents scored >= d + the relevant ones scored above d, or equal with a lower index.
    """
    scores = _score_matrix(scores)
    num_queries, num_documents = scores.shape
    relevant = _as_list(relevant, "relevant")
    if len(relevant) != num_queries:
        raise ValueError(
            f"relevant has {len(relevant)} entries but scores has {num_queries} queries (shape {scores.shape}); "
            "expected the relevant document ids of each query"
        )
    ranks = []
    for query, ids in enumerate(relevant):
        ids = [ids] if isinstance(ids, (int, np.integer)) else _as_list(ids, f"relevant[{query}]")
        if not ids:
            raise ValueError(f"relevant[{query}] is empty; expected at least one relevant document id")
        for document in ids:
            if isinstance(document, bool) or not isinstance(document, (int, np.integer)):
                raise TypeError(f"relevant[{query}] holds {document!r}; expected integer document ids")
            if not 0 <= document < num_documents:
                raise ValueError(
                    f"relevant[{query}] holds document {document}, outside [0, {num_documents}) "
                    f"(scores has {num_documents} documents)"
                )
        if len(set(ids)) != len(ids):
            raise ValueError(f"relevant[{query}] = {ids} repeats a document id")
        row = scores[query]
        is_relevant = np.zeros(num_documents, dtype=bool)
        is_relevant[ids] = True
        index = np.arange(num_documents)
        query_ranks = []
        for document in ids:
            above = (~is_relevant & (row >= row[document])) | (
                is_relevant & ((row > row[document]) | ((row == row[document]) & (index < document)))
            )
            query_ranks.append(1 + int(above.sum()))
        ranks.append(np.array(query_ranks))
    return ranks


def retrieval_scores(scores, relevant, mrr_at: int = 10, recall_at=(1, 10)) -> dict:
    """{"mrr@10", "recall@1", "recall@10"} (keys follow mrr_at and recall_at), means over queries.

    scores: (queries, documents), higher = more relevant. relevant: per query a document id
    or a collection of them. MRR@k: 1 / the rank of the best-ranked relevant document, 0
    when it is below k. recall@k: the fraction of the query's relevant documents ranked in
    the top k (with one relevant document: whether it is). Ranks are pessimistic
    (relevant_ranks).
    """
    mrr_at, recall_at = _cutoffs(mrr_at, recall_at)
    ranks = relevant_ranks(scores, relevant)
    results = {f"mrr@{mrr_at}": float(np.mean([1.0 / r.min() if r.min() <= mrr_at else 0.0 for r in ranks]))}
    for k in recall_at:
        results[f"recall@{k}"] = float(np.mean([(r <= k).mean() for r in ranks]))
    return results


def paired_retrieval_scores(scores, mrr_at: int = 10, recall_at=(1, 10)) -> dict:
    """retrieval_scores where query i's one relevant document is document i: the in-batch
    setting of a (query, document) pair list, every other document a distractor. Extra
    documents past the last query are distractors too."""
    matrix = _score_matrix(scores)
    num_queries, num_documents = matrix.shape
    if num_documents < num_queries:
        raise ValueError(
            f"scores has {num_queries} queries but {num_documents} documents (shape {matrix.shape}); "
            "paired scoring needs document i for each query i"
        )
    return retrieval_scores(matrix, list(range(num_queries)), mrr_at, recall_at)
