"""Speed options shared by every model: mixed precision and XLA.

`set_precision` picks the Keras dtype policy *before* a model is built:
towers then compute in bfloat16 (CPU, GPU) or float16 (GPU only) while
variables, losses, all-gathers and evaluation stay float32 (every model casts
its outputs to float32).  Under ``mixed_float16`` Keras wraps the optimizer in
a `LossScaleOptimizer`; the models' ``train_step`` scales the loss through
``optimizer.scale_loss``.  XLA (``jit_compile``) compiles the whole train
step; the tolerances against float32 are checked in ``tests/test_speed.py``
and stated in BUILD_NOTES.md.

`best_matmul_seconds` times this machine's float32 `tf.matmul`: the main
job's time estimate and the benchmarks' same-run ratios rest on it.
"""
from __future__ import annotations

import time

import keras
import tensorflow as tf

from tf_twobranch.errors import ConfigError

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")

__all__ = ["PRECISIONS", "set_precision", "precision_scope", "best_matmul_seconds"]


def set_precision(precision: str) -> str:
    """Sets the global Keras dtype policy; returns its name."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "mixed_float16" and not tf.config.list_physical_devices("GPU"):
        raise ConfigError("precision=mixed_float16 needs a GPU (float16 matmuls are emulated "
                          "and slow on CPU); use mixed_bfloat16 on CPU")
    keras.mixed_precision.set_global_policy(precision)
    return precision


class precision_scope:  # noqa: N801 - used as a context manager
    """Temporarily sets the dtype policy (tests, benchmarks)."""

    def __init__(self, precision: str):
        self.precision = precision

    def __enter__(self):
        self._previous = keras.mixed_precision.global_policy().name
        set_precision(self.precision)
        return self

    def __exit__(self, *exc):
        keras.mixed_precision.set_global_policy(self._previous)
        return False


def best_matmul_seconds(rows: int, inner: int, cols: int, *, warmups: int = 1,
                        repeats: int = 3) -> float:
    """The fastest of `repeats` float32 (rows × inner) @ (inner × cols) `tf.matmul`s, after `warmups`."""
    a = tf.random.stateless_normal((rows, inner), seed=(0, 0))
    b = tf.random.stateless_normal((inner, cols), seed=(0, 1))
    for _ in range(warmups):
        tf.matmul(a, b).numpy()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        tf.matmul(a, b).numpy()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)
