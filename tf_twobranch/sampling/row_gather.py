"""Rows of (memory-mapped) arrays gathered into a tf.data pipeline, batch by batch.

No dataset array ever enters the graph as a constant (a ``tf.constant`` copies
the whole array, several times over inside tf.data, and fails past 2 GB):
each batch's rows are read by index from the array where it lives, in RAM or
memory-mapped on disk (`tf_twobranch.data.formats.row_arrays`), and cast to the
dtype the model takes (float16 storage is cast back to float32 here).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["gather_op"]


def gather_op(array, indices: tf.Tensor, dtype=None) -> tf.Tensor:
    """`array[indices]` as a tensor of `dtype`, its shape known but the batch.

    Default dtype: float32 for floating arrays (float16 storage is widened
    here), the array's own otherwise (token ids, masks).
    """
    storage = np.dtype(array.dtype)
    if dtype is None:
        dtype = np.float32 if storage.kind == "f" else storage
    dtype = np.dtype(dtype)
    # float16 storage is read as it is and widened by a graph cast: numpy's half -> float
    # conversion is scalar (~60 ms for a fragment batch of 8.2M values here, ~7 ms for TensorFlow's),
    # and it ran inside the GIL-holding read (benchmarks/bench_input_pipelines.py).
    read_dtype = storage if storage == np.float16 and dtype.kind == "f" else dtype

    def read(index):
        return np.asarray(array[np.asarray(index, np.int64)], dtype=read_dtype)

    rows = tf.numpy_function(read, [indices], tf.as_dtype(read_dtype), stateful=False)
    rows.set_shape(indices.shape.concatenate(array.shape[1:]))
    return rows if read_dtype == dtype else tf.cast(rows, tf.as_dtype(dtype))
