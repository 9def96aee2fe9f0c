"""The contract every system's model keeps, in code.

`SystemModel` is the one `keras.Model` the four systems' models derive from
(`tf_twobranch.systems.<name>.model`). It writes `train_step`, `test_step`,
the logged metrics and `evaluate` once; a system's model supplies

* ``CONFIG_CLASS``: its configuration dataclass (a `ModelConfig`:
  ``to_dict`` / ``from_dict``, unknown keys are a `ConfigError`), written
  beside the weights by `SystemModel.save_config` and read back by
  ``<Model>.load_config`` — the one writer (`json_files.write_json`, atomic)
  and the one reader;
* ``objective(batch, training) -> dict`` of loss terms, ``"loss"`` the total
  the trainer minimises (under a multi-replica strategy: see
  ``GLOBAL_LOSS``);
* ``LOGGED_TERMS``: the terms `fit` logs as running means;
* ``evaluate_split(split, protocol=..., **EVALUATION_OPTIONS)`` -> metrics of
  a test split through the one evaluation core (`tf_twobranch.evaluation`),
  where `split` is what `load_run(...).evaluation_split()` gives;
* its ``embed_*`` / score methods.

Hooks where a system trains differently: ``apply_gradients`` (the
two-branch XLA-compiled update, the fragment CNN's smaller step) and
``update_metrics`` (the dual path's accuracies).
`tf_twobranch.runs.load_run` finds a run's system through the registry.
"""
from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, TypeVar

import keras
import tensorflow as tf

from tf_twobranch import distribute
from tf_twobranch.batching import unpack_batch
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.json_files import read_json_object, write_json
from tf_twobranch.models.evaluation_input import reject_unused_arguments

__all__ = ["ModelConfig", "SystemModel", "save_model_config", "load_model_config"]

ConfigT = TypeVar("ConfigT", bound="ModelConfig")


class ModelConfig:
    """Base of the families' configuration dataclasses (JSON-serialisable)."""

    FAMILY: ClassVar[str] = ""         # the system's model family (results.json "family")
    FILE_NAME: ClassVar[str] = ""      # the configuration file beside the weights
    DESCRIPTION: ClassVar[str] = ""    # what the file holds, for error messages

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls: type[ConfigT], d: dict) -> ConfigT:
        if not isinstance(d, dict):
            raise ConfigError(f"a {cls.DESCRIPTION} must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown {cls.DESCRIPTION} keys: {unknown}")
        try:
            return cls(**d)
        except TypeError as err:   # a required key is missing
            raise ConfigError(f"{cls.DESCRIPTION}: {err}") from None


def save_model_config(path: str | os.PathLike, config: ModelConfig, **extra) -> None:
    """Writes ``{"model": config, **extra}`` beside a model's weights, whole or not at all."""
    write_json(path, {"model": config.to_dict(), **extra})


def load_model_config(path: str | os.PathLike, config_class: type[ConfigT]) -> tuple[ConfigT, dict]:
    """The configuration written by `save_model_config` and its extra entries."""
    data = read_json_object(path, config_class.DESCRIPTION)
    if not isinstance(data.get("model"), dict):
        raise DataFormatError(path, "expected a JSON object with a 'model' object")
    try:
        return config_class.from_dict(data.pop("model")), data
    except ConfigError as err:
        raise DataFormatError(path, str(err), record="model") from None


class SystemModel(keras.Model):
    """The base of the four systems' models: one training step, one `evaluate` (module docstring)."""

    CONFIG_CLASS: ClassVar[type[ModelConfig]] = ModelConfig
    LOGGED_TERMS: ClassVar[tuple[str, ...]] = ("loss",)
    # Keyword arguments of `evaluate_split`, kept from Keras' own `evaluate` (which also
    # takes ``batch_size``) so that a test split and a Dataset read them the same way.
    EVALUATION_OPTIONS: ClassVar[tuple[str, ...]] = ()
    # True where every replica computes the whole global batch's loss from gathered
    # tower outputs (the two-branch ranking terms): each replica then applies its
    # 1/replicas share, so that the summed update is the single-device one.
    GLOBAL_LOSS: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.term_trackers = [keras.metrics.Mean(name=term) for term in self.LOGGED_TERMS]

    # --- what a system's model writes ------------------------------------------------
    def objective(self, batch, training: bool = True) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must define objective(batch, training)")

    def evaluate_split(self, x, protocol: str | None = None, **options) -> dict:
        raise NotImplementedError(f"{type(self).__name__} must define evaluate_split(split, protocol)")

    def apply_gradients(self, grads) -> None:
        self.optimizer.apply(grads, self.trainable_variables)

    def update_metrics(self, terms: dict) -> dict:
        """Updates the logged metrics with one batch's terms; returns the logs."""
        for tracker in self.term_trackers:
            tracker.update_state(terms[tracker.name])
        return {m.name: m.result() for m in self.metrics}

    # --- written once ------------------------------------------------------------------
    @property
    def loss_tracker(self) -> keras.metrics.Mean:
        return self.term_trackers[0]

    @property
    def metrics(self):
        return list(self.term_trackers)

    def train_step(self, data):
        batch = unpack_batch(data)
        with tf.GradientTape() as tape:
            terms = self.objective(batch, training=True)
            loss = distribute.replica_share(terms["loss"]) if self.GLOBAL_LOSS else terms["loss"]
            # scale_loss is the identity except under a float16 LossScaleOptimizer.
            scaled = self.optimizer.scale_loss(loss)
        self.apply_gradients(tape.gradient(scaled, self.trainable_variables))
        return distribute.keras_logs(self.update_metrics(terms))

    def test_step(self, data):
        return distribute.keras_logs(self.update_metrics(self.objective(unpack_batch(data), training=False)))

    def evaluate(self, x=None, y=None, *, protocol: str | None = None, **kwargs) -> dict:
        """The metrics of a test split (`evaluate_split`: an `EvaluationSplit`, e.g.
        `load_run(...).evaluation_split()`, or a dict / object with its arrays,
        `models.evaluation_input`) under `protocol` (default: the split's). A
        `tf.data.Dataset` of training-style batches (as `fit` passes validation data) gets
        Keras' own `evaluate` instead: the loss terms of `test_step`, as a dict."""
        options = {k: kwargs.pop(k) for k in self.EVALUATION_OPTIONS if k in kwargs}
        if isinstance(x, tf.data.Dataset):
            kwargs.setdefault("return_dict", True)
            return super().evaluate(x, y, **kwargs)
        reject_unused_arguments(kwargs, type(self).__name__)
        return self.evaluate_split(x, protocol=protocol, **options)

    # --- the configuration beside the weights -------------------------------------------
    def save_config(self, path: str | os.PathLike, **extra) -> None:
        save_model_config(path, self.config, **extra)

    @classmethod
    def load_config(cls, path: str | os.PathLike) -> tuple[ModelConfig, dict]:
        """The configuration (`CONFIG_CLASS`) and extra entries written by `save_config`."""
        return load_model_config(path, cls.CONFIG_CLASS)
