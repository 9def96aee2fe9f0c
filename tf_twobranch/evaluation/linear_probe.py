"""Linear probe of image features: do they linearly separate a known label?

Used on the embedded digit scenes to check that region features actually
see the digits: a multinomial logistic regression is fitted on the features
of ground-truth object crops of *training* scenes and scored on those of
*test* scenes (`linear_probe_accuracy`).  The digit class of a box is read
from the phrases that refer to it (`digit_class_of_phrases`,
`digit_object_boxes`); boxes whose phrases name no class, or several, are
skipped rather than guessed.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Iterable, Sequence

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from tf_twobranch.data.phrases import PhraseExample
from tf_twobranch.data.scene_grammar import DIGIT_PLURALS, DIGIT_WORDS
from tf_twobranch.errors import UserInputError

__all__ = ["linear_probe_accuracy", "chance_accuracy", "digit_classes_named", "digit_class_of_phrases",
           "DigitBoxes", "digit_object_boxes"]

_DIGIT_CLASS = {**{w: d for d, w in enumerate(DIGIT_WORDS)}, **{w: d for d, w in enumerate(DIGIT_PLURALS)},
                **{str(d): d for d in range(10)}, **{f"{d}s": d for d in range(10)}}
# "one"/"two" are also counts: "one red seven", "two red sevens", "the two sixes".
_COUNT_WORDS = frozenset({"one", "two"})
_DETERMINERS = frozenset({"a", "an", "the", "one", "two"})


def _as_features(features, name: str) -> np.ndarray:
    array = np.asarray(features, dtype=np.float64)
    if array.ndim != 2 or len(array) == 0:
        raise UserInputError(f"{name} must be a non-empty (N, D) matrix, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise UserInputError(f"{name} holds NaN or inf in {int((~np.isfinite(array)).any(axis=1).sum())} row(s)")
    return array


def _as_labels(labels, rows: int, name: str) -> np.ndarray:
    array = np.asarray(labels)
    if array.shape != (rows,):
        raise UserInputError(f"{name} needs one label per feature row ({rows}), got shape {array.shape}")
    return array


def linear_probe_accuracy(train_features, train_labels, test_features, test_labels, *,
                          seed: int = 0, regularization: float = 1.0, max_iter: int = 2000) -> float:
    """Test accuracy of a logistic regression fitted on standardised training features.

    The standardisation (mean, scale) is fitted on the training features
    only.  `regularization` is scikit-learn's inverse strength ``C``.

    Raises:
      UserInputError: shapes that disagree, non-finite features, or fewer
        than two classes among the training labels.
    """
    train = _as_features(train_features, "train_features")
    test = _as_features(test_features, "test_features")
    if train.shape[1] != test.shape[1]:
        raise UserInputError(f"train and test features differ in dimension: {train.shape[1]} vs {test.shape[1]}")
    y_train = _as_labels(train_labels, len(train), "train_labels")
    y_test = _as_labels(test_labels, len(test), "test_labels")
    if len(np.unique(y_train)) < 2:
        raise UserInputError(f"a probe needs at least two classes among the training labels, got {np.unique(y_train)}")
    scaler = StandardScaler().fit(train)
    probe = LogisticRegression(C=regularization, max_iter=max_iter, random_state=seed)
    probe.fit(scaler.transform(train), y_train)
    return float(np.mean(probe.predict(scaler.transform(test)) == y_test))


def chance_accuracy(train_labels, test_labels) -> float:
    """Accuracy of always answering the most frequent training label."""
    values, counts = np.unique(np.asarray(train_labels), return_counts=True)
    return float(np.mean(np.asarray(test_labels) == values[np.argmax(counts)]))


def digit_classes_named(phrase: str) -> set[int]:
    """The digit classes (0-9) a phrase names: "a small red seven" -> {7}.

    Digit words, plurals and numerals count ("sevens", "7", "7s"); "one" and
    "two" right after a determiner (or opening the phrase) and followed by
    more of the noun phrase are counts, not classes ("two red sevens" ->
    {7}, "two yellow digits" -> {}), while "a two", "the two in red" name
    the class 2.
    """
    tokens = re.findall(r"[a-z0-9]+", phrase.lower())
    classes = set()
    for i, token in enumerate(tokens):
        digit = _DIGIT_CLASS.get(token)
        if digit is None:
            continue
        followed = i + 1 < len(tokens) and tokens[i + 1] != "in"
        if token in _COUNT_WORDS and followed and (i == 0 or tokens[i - 1] in _DETERMINERS):
            continue
        classes.add(digit)
    return classes


def digit_class_of_phrases(phrases: Iterable[str]) -> int | None:
    """The one digit class the phrases of a box name together, or None (none or several)."""
    classes = set().union(*(digit_classes_named(p) for p in phrases))
    return classes.pop() if len(classes) == 1 else None


@dataclasses.dataclass
class DigitBoxes:
    """Ground-truth object boxes labelled with the digit class their phrases name.

    Attributes:
      image_ids: (N,) image of each box.
      boxes: float32 (N, 4) inclusive 0-based [x1, y1, x2, y2] (one per object:
        a plural chain contributes each of its boxes).
      labels: int64 (N,) digit classes.
      skipped_chains: chains with a box whose phrases name no digit class or several.
    """

    image_ids: list[str]
    boxes: np.ndarray
    labels: np.ndarray
    skipped_chains: int

    def by_image(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """image id -> (boxes, labels), in first-appearance order."""
        rows: dict[str, list[int]] = collections.defaultdict(list)
        for row, image_id in enumerate(self.image_ids):
            rows[image_id].append(row)
        return {i: (self.boxes[r], self.labels[r]) for i, r in rows.items()}


def digit_object_boxes(examples: Sequence[PhraseExample]) -> DigitBoxes:
    """Labels every object box of `examples` (`tf_twobranch.data.phrases.build_phrase_examples`)
    with the digit class named by all the phrases of its chain."""
    phrases: dict[tuple[str, str], list[str]] = {}
    chain_boxes: dict[tuple[str, str], np.ndarray] = {}
    for example in examples:
        key = (example.image_id, example.chain_id)
        phrases.setdefault(key, []).append(example.phrase)
        chain_boxes[key] = np.asarray(example.gt_boxes, np.float32).reshape(-1, 4)
    image_ids, boxes, labels, skipped = [], [], [], 0
    for key, texts in phrases.items():
        digit = digit_class_of_phrases(texts)
        if digit is None:
            skipped += 1
            continue
        for box in chain_boxes[key]:
            image_ids.append(key[0])
            boxes.append(box)
            labels.append(digit)
    return DigitBoxes(image_ids, np.asarray(boxes, np.float32).reshape(-1, 4),
                      np.asarray(labels, np.int64), skipped)
