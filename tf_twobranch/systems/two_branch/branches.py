"""Branch towers of the two-branch networks (functional Keras models).

Two layouts of the nonlinear branch exist:

* ``"original"`` (default) — `lwwang/Two_branch_network`: FC → batch norm
  (TF momentum 0.1, epsilon 1e-5) → ReLU → dropout → FC → L2 normalise.
* ``"paper"`` — TPAMI §3.2.1: FC → ReLU → dropout → FC → batch norm → L2.

A *linear* branch (no hidden layer) follows TPAMI §4.2: a single FC layer
immediately followed by L2 normalisation (in the paper layout batch norm
stays after it). Its output size is the embedding size, so the similarity
head and the embedding space stay the same as for the nonlinear branch
(see BUILD_NOTES.md).
"""
from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from tf_twobranch.errors import ConfigError

BRANCH_LAYOUTS = ("original", "paper")


@keras.saving.register_keras_serializable(package="tf_twobranch")
class L2Normalize(keras.layers.Layer):
    """x / max(||x||, sqrt(eps)) along the last axis (tf.nn.l2_normalize)."""

    def __init__(self, epsilon: float = 1e-10, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def call(self, x):
        return tf.nn.l2_normalize(x, axis=-1, epsilon=self.epsilon)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}


def _batch_norm(name):
    # Keras and TF1's tf.layers.batch_normalization share the momentum
    # convention (moving = momentum·moving + (1−momentum)·batch), so the
    # original's momentum=0.1 carries over unchanged.
    # Built under a multi-replica strategy, the statistics are those of the
    # global batch (synchronized), so distributed training computes what one
    # device would on the same global batch.
    synchronized = tf.distribute.get_strategy().num_replicas_in_sync > 1
    return keras.layers.BatchNormalization(momentum=0.1, epsilon=1e-5, name=name,
                                           synchronized=synchronized)


def branch_layers(x, *, hidden_dims: Sequence[int], output_dim: int, layout: str,
                  dropout: float, name: str):
    """Applies the branch layers to tensor `x` and returns the L2-normalised output."""
    if layout not in BRANCH_LAYOUTS:
        raise ConfigError(f"branch layout must be one of {BRANCH_LAYOUTS}, got {layout!r}")
    hidden_dims = list(hidden_dims)
    if not hidden_dims:  # linear branch: the first FC layer only
        x = keras.layers.Dense(output_dim, name=f"{name}_fc1")(x)
        if layout == "paper":
            x = _batch_norm(f"{name}_bn1")(x)
        return L2Normalize(name=f"{name}_l2")(x)
    for i, dim in enumerate(hidden_dims, start=1):
        x = keras.layers.Dense(dim, name=f"{name}_fc{i}")(x)
        if layout == "original":
            x = _batch_norm(f"{name}_bn{i}")(x)
        x = keras.layers.ReLU(name=f"{name}_relu{i}")(x)
        if dropout:
            x = keras.layers.Dropout(dropout, seed=0, name=f"{name}_dropout{i}")(x)
    last = len(hidden_dims) + 1
    x = keras.layers.Dense(output_dim, name=f"{name}_fc{last}")(x)
    if layout == "paper":
        x = _batch_norm(f"{name}_bn{last}")(x)
    return L2Normalize(name=f"{name}_l2")(x)


def build_feature_branch(input_dim: int, *, hidden_dims: Sequence[int] = (2048,),
                         output_dim: int = 512, layout: str = "original",
                         dropout: float = 0.5, name: str = "branch") -> keras.Model:
    """A tower on precomputed feature vectors: (batch, input_dim) → (batch, d)."""
    if input_dim <= 0 or output_dim <= 0 or any(d <= 0 for d in hidden_dims):
        raise ConfigError(f"branch {name}: dimensions must be positive "
                          f"(input {input_dim}, hidden {list(hidden_dims)}, output {output_dim})")
    inputs = keras.Input(shape=(input_dim,), dtype="float32", name=f"{name}_features")
    outputs = branch_layers(inputs, hidden_dims=hidden_dims, output_dim=output_dim,
                            layout=layout, dropout=dropout, name=name)
    return keras.Model(inputs, outputs, name=name)
