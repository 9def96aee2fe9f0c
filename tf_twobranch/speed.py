"""Speed options shared by every model: mixed precision and XLA.

`set_precision` picks the Keras dtype policy *before* a model is built:
towers then compute in bfloat16 (CPU, GPU) or float16 (GPU only) while
variables, losses, all-gathers and evaluation stay float32 (every model casts
its outputs to float32).  Under ``mixed_float16`` Keras wraps the optimizer in
a `LossScaleOptimizer`; the models' ``train_step`` scales the loss through
``optimizer.scale_loss``.  XLA (``jit_compile``) compiles the whole train
step; the tolerances against float32 are checked in ``tests/core/test_speed.py``
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


# The estimates the main job and the leaderboard print first: reference seconds measured on the
# machine of BUILD_NOTES.md (2-core AVX-512 EPYC, whose TensorFlow matmul probe read about
# REFERENCE_GFLOPS), scaled by this machine's probe. Most of a job does not speed up with the probe
# (an AMX machine reading 1.94x the reference ran the main job in 0.88x its time), so a faster probe
# is credited down to FASTEST_FACTOR only; the printed range (ESTIMATE_SPREAD) covers the AVX2
# machines, up to ~1.2x slower than the probe predicts.
REFERENCE_GFLOPS = 190.0
FASTEST_FACTOR = 0.85
ESTIMATE_SPREAD = 1.3


def matmul_gflops() -> float:
    """A quick (~0.1 s) probe of this machine's speed: the best of a few float32 `tf.matmul`s (what the
    runs run; numpy's BLAS ranks machines differently)."""
    return 2 * 1024 ** 3 / best_matmul_seconds(1024, 1024, 1024, warmups=3, repeats=8) / 1e9


def estimate_on_this_machine(reference_seconds: float) -> float:
    """`reference_seconds` of the reference machine, scaled to this one (the comment above)."""
    return reference_seconds * max(REFERENCE_GFLOPS / max(matmul_gflops(), 1e-3), FASTEST_FACTOR)
