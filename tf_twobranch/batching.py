"""Running a Keras model over arrays in fixed-size batches.

One traced inference function is kept per model (`inference_function`):
creating a `tf.function` per call retraces the model every time (slow, and
TensorFlow logs "triggered tf.function retracing" warnings).
"""
from __future__ import annotations

from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.errors import UserInputError

__all__ = ["unpack_batch", "in_batches", "inference_function"]

_CACHE_ATTRIBUTE = "_tf_twobranch_inference"


def unpack_batch(data):
    """The batch dict, whether Keras passed it alone or as (x, y, sample_weight)."""
    if isinstance(data, (tuple, list)):
        data = data[0]
    return data


def inference_function(model: keras.Model) -> Callable:
    """`model(x, training=False)` as one `tf.function`, traced once and kept on the model."""
    forward = getattr(model, _CACHE_ATTRIBUTE, None)
    if forward is None:
        forward = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
        setattr(model, _CACHE_ATTRIBUTE, forward)
    return forward


def in_batches(fn: Callable, inputs, batch_size: int) -> np.ndarray:
    """`fn` applied to consecutive `batch_size` rows of `inputs`, outputs concatenated."""
    inputs = np.asarray(inputs)
    if len(inputs) == 0:
        raise UserInputError("nothing to embed: empty input")
    if batch_size < 1:
        raise UserInputError(f"batch_size must be positive, got {batch_size}")
    return np.concatenate([keras.ops.convert_to_numpy(fn(tf.constant(inputs[i:i + batch_size])))
                           for i in range(0, len(inputs), batch_size)], axis=0)
