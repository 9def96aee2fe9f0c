"""What `evaluate` takes, the same for every model family.

`model.evaluate(x)` with an `EvaluationSplit` (`tf_twobranch.evaluation.split`),
a dict of arrays or an object with those attributes — ``image`` (one input
row per test image), ``text`` (one input row per caption: features, strings
or token ids, whatever the model's text tower takes) and ``caption_image``
(the image index of each caption), optionally ``protocol`` and the dual
path's ``caption_of_row`` / ``image_class`` — returns the retrieval metrics
of the one evaluation core (`tf_twobranch.evaluation.retrieval`):
``i2t_r1 … t2i_meanr, rsum``. With a `tf.data.Dataset` of training-style
batches it is Keras' `evaluate`: the loss terms of `test_step`, as `fit`
reports them for validation data.
"""
from __future__ import annotations

import numpy as np

from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.split import EvaluationSplit

__all__ = ["RETRIEVAL_KEYS", "OPTIONAL_KEYS", "as_evaluation_split", "reject_unused_arguments"]

RETRIEVAL_KEYS = ("image", "text", "caption_image")
OPTIONAL_KEYS = ("protocol", "caption_of_row", "image_class")


def as_evaluation_split(x, protocol: str | None = None) -> EvaluationSplit:
    """The test split given as an `EvaluationSplit`, a dict or an object with those attributes.

    `protocol`, when given, overrides the split's own (default "full").
    """
    if x is None:
        raise UserInputError("evaluate() needs the test data: a dict with 'image', 'text' and "
                             "'caption_image' (or a tf.data.Dataset of training batches)")
    if not isinstance(x, dict):
        x = {k: getattr(x, k) for k in RETRIEVAL_KEYS + OPTIONAL_KEYS if hasattr(x, k)}
    missing = [k for k in RETRIEVAL_KEYS if k not in x]
    if missing:
        raise UserInputError(f"evaluate() data lacks {missing}; expected the keys "
                             f"{list(RETRIEVAL_KEYS)}")
    unknown = sorted(set(x) - set(RETRIEVAL_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise UserInputError(f"evaluate() data has unknown keys {unknown}; expected "
                             f"{list(RETRIEVAL_KEYS)} and optionally {list(OPTIONAL_KEYS)}")
    optional = {k: (None if x.get(k) is None else np.asarray(x[k]))
                for k in ("caption_of_row", "image_class")}
    return EvaluationSplit(x["image"], x["text"], np.asarray(x["caption_image"]),
                           protocol=protocol or x.get("protocol") or "full", **optional)


def reject_unused_arguments(kwargs: dict, model_name: str) -> None:
    """Keras-style arguments that change nothing here are refused, not ignored."""
    kwargs = dict(kwargs)
    kwargs.pop("verbose", None)  # nothing is printed either way
    if kwargs.pop("return_dict", True) is not True:
        raise UserInputError("evaluate() of a retrieval split returns a dict of metrics; "
                             "return_dict=False is not supported")
    if kwargs:
        raise UserInputError(f"{model_name}.evaluate() does not take {sorted(kwargs)} for a "
                             "retrieval split")
