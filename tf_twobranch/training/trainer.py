"""Training runs: strategy, optimiser, schedule, checkpoints, logs.

A run directory holds everything needed to rebuild the model:

    run_dir/
      run_config.json          model config + training flags + data provenance
      checkpoints/epoch_XXXX.weights.h5, latest.weights.h5
      backup/                  BackupAndRestore state (resume after preemption)
      logs/                    TensorBoard
      results.json             evaluation results (written by experiments)
      export/                  SavedModel (written by tf_twobranch.export)
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile

import keras
import tensorflow as tf
from absl import logging

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.models.two_branch import TwoBranchConfig, TwoBranchModel, build_model

STRATEGIES = ("default", "mirrored", "multi_worker", "tpu")


def get_strategy(name: str = "default") -> tf.distribute.Strategy:
    """One flag selects the distribution strategy."""
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker":
        if "TF_CONFIG" not in os.environ:
            raise ConfigError("strategy=multi_worker needs the TF_CONFIG environment variable "
                              "(cluster spec and this worker's task)")
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except (ValueError, tf.errors.NotFoundError) as e:
            raise ConfigError(f"strategy=tpu: no TPU available here ({e})") from None
        return tf.distribute.TPUStrategy(resolver)
    raise ConfigError(f"unknown strategy {name!r}; expected one of {STRATEGIES}")


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 20
    steps_per_epoch: int = 0        # 0: derived from the data
    learning_rate: float = 1e-4
    # The original computes an exponential decay (0.794 per epoch) but never
    # passes it to the optimiser; "none" reproduces that, "exponential" uses it.
    lr_schedule: str = "none"
    lr_decay_rate: float = 0.794
    optimizer: str = "adam"
    weight_decay: float = 0.0
    seed: int = 0
    strategy: str = "default"
    verbose: int = 1

    def validate(self):
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.lr_schedule not in ("none", "exponential"):
            raise ConfigError(f"lr_schedule must be 'none' or 'exponential', got "
                              f"{self.lr_schedule!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")


def make_optimizer(cfg: TrainConfig, steps_per_epoch: int) -> keras.optimizers.Optimizer:
    lr = cfg.learning_rate
    if cfg.lr_schedule == "exponential":
        lr = keras.optimizers.schedules.ExponentialDecay(
            cfg.learning_rate, decay_steps=steps_per_epoch, decay_rate=cfg.lr_decay_rate,
            staircase=True)
    if cfg.optimizer == "adam":
        return keras.optimizers.Adam(lr, weight_decay=cfg.weight_decay or None)
    return keras.optimizers.SGD(lr, momentum=0.9, weight_decay=cfg.weight_decay or None)


def write_json_atomic(path, payload):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def prepare_run_dir(run_dir, run_config: dict) -> pathlib.Path:
    """Writes run_config.json; a leftover backup of a *different* run is discarded.

    A preempted run restarted with the same command resumes from its backup;
    a backup left by a run with another configuration must not be restored
    into this one.
    """
    run_dir = pathlib.Path(run_dir)
    config_path = run_dir / "run_config.json"
    backup = run_dir / "backup"
    if backup.exists():
        try:
            previous = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            previous = None
        if json.loads(json.dumps(run_config, default=str)) != previous:
            logging.warning("%s: discarding the backup of an unfinished run with a different "
                            "configuration", run_dir)
            shutil.rmtree(backup)
    write_json_atomic(config_path, run_config)
    return run_dir


class _AtomicEpochCheckpoint(keras.callbacks.Callback):
    """Writes weights each epoch to a temp file then renames it (never half-written)."""

    def __init__(self, directory: pathlib.Path, keep: int = 3):
        super().__init__()
        self.directory = directory
        self.keep = keep

    def on_epoch_end(self, epoch, logs=None):
        self.directory.mkdir(parents=True, exist_ok=True)
        for name in (f"epoch_{epoch + 1:04d}.weights.h5", "latest.weights.h5"):
            tmp = self.directory / f".tmp_{name}"
            self.model.save_weights(tmp)
            os.replace(tmp, self.directory / name)
        epochs = sorted(self.directory.glob("epoch_*.weights.h5"))
        for old in epochs[:-self.keep]:
            old.unlink()


def train(model: TwoBranchModel, dataset: tf.data.Dataset, cfg: TrainConfig, run_dir,
          *, steps_per_epoch: int, extra_callbacks=(), initial_epoch: int = 0,
          epochs: int | None = None) -> keras.callbacks.History:
    """Fits `model` on an infinite dataset with checkpoints, backup and logs."""
    cfg.validate()
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if getattr(model, "optimizer", None) is None or not model.compiled:
        model.compile(optimizer=make_optimizer(cfg, steps_per_epoch))
    callbacks = [
        # The backup exists only while a run is unfinished: a run killed
        # mid-epoch resumes from it; a finished run deletes it.
        keras.callbacks.BackupAndRestore(str(run_dir / "backup"), delete_checkpoint=True),
        _AtomicEpochCheckpoint(run_dir / "checkpoints"),
        keras.callbacks.TensorBoard(str(run_dir / "logs"), update_freq="epoch",
                                    write_graph=False),
        keras.callbacks.TerminateOnNaN(),
        *extra_callbacks,
    ]
    history = model.fit(dataset, epochs=epochs or cfg.epochs, steps_per_epoch=steps_per_epoch,
                        initial_epoch=initial_epoch, callbacks=callbacks, verbose=cfg.verbose)
    losses = history.history.get("loss", [])
    if losses and not all(map(lambda v: v == v, losses)):  # NaN check
        raise UserInputError(
            f"training produced a NaN loss; the last good weights are in "
            f"{run_dir / 'checkpoints'} (check the input features for extreme values "
            f"or lower the learning rate)")
    return history


def load_trained_model(run_dir, checkpoint: str = "latest") -> tuple[TwoBranchModel, dict]:
    """Rebuilds a model from `run_dir/run_config.json` and loads its weights."""
    run_dir = pathlib.Path(run_dir)
    config_path = run_dir / "run_config.json"
    if not config_path.exists():
        raise UserInputError(f"{config_path}: no run configuration here; is {run_dir} a run "
                             f"directory written by tf_twobranch?")
    try:
        run_config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserInputError(f"{config_path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    model = build_model(TwoBranchConfig.from_dict(run_config["model"]))
    weights = run_dir / "checkpoints" / f"{checkpoint}.weights.h5"
    if not weights.exists():
        raise UserInputError(f"{weights}: checkpoint not found")
    model.load_weights(weights)
    return model, run_config
