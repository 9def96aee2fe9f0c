"""Training runs: strategy, optimiser, schedule, checkpoints, logs.

A run directory holds everything needed to rebuild the model:

    run_dir/
      run_config.json          model config + training flags + data provenance
      checkpoints/epoch_XXXX.weights.h5, latest.weights.h5
      backup/epochs_A_B/       state of an unfinished train() call (resume after
                               preemption at the exact step; see `train`)
      logs/                    TensorBoard
      results.json             evaluation results (written by experiments)
      export/                  SavedModel (written by tf_twobranch.export)

Multi-worker training (`MultiWorkerMirroredStrategy`): `run_dir` must be on a
filesystem every worker sees (as on a cluster).  Only the chief (task type
"chief", or worker 0 when the cluster has no chief; `is_chief`) writes into
it; the other workers run exactly the same save calls (reading metric
variables and some weights is a collective op under this strategy, so every
worker must take part) but into a private temporary directory that `train`
deletes at the end.  Every worker resumes from the chief's backup in
`run_dir/backup`, and the workers check, with a collective, that they all
resume from the same step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.distribute import (STRATEGIES, cluster_resolver, distribute_global_batches, is_chief,
                                     is_multi_worker, without_autotuning)
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.json_files import write_json
from tf_twobranch.training.fit_timing import model_params, reports_fit

def _gather_over_workers(strategy: tf.distribute.Strategy, value: int) -> list[int]:
    """`value` of every replica of the cluster (a collective: every worker must call it)."""
    @tf.function
    def gather():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            return ctx.all_gather(tf.constant([value], tf.int64), axis=0)
        return strategy.run(replica_fn)
    result = strategy.experimental_local_results(gather())[0]
    return [int(v) for v in np.asarray(result)]


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
    # Preemption: also back up every this many steps within an epoch
    # (0: at epoch ends only). A backup costs one weights write.
    backup_every_steps: int = 0
    # Deterministic kernels + seeded RNGs at the start of train(), so that a
    # resumed run ends with the same weights as an uninterrupted one.
    deterministic: bool = False

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
        if self.backup_every_steps < 0:
            raise ConfigError(f"backup_every_steps must be >= 0, got {self.backup_every_steps}")


def make_optimizer(cfg: TrainConfig, steps_per_epoch: int) -> keras.optimizers.Optimizer:
    lr = cfg.learning_rate
    if cfg.lr_schedule == "exponential":
        lr = keras.optimizers.schedules.ExponentialDecay(
            cfg.learning_rate, decay_steps=steps_per_epoch, decay_rate=cfg.lr_decay_rate,
            staircase=True)
    if cfg.optimizer == "adam":
        return keras.optimizers.Adam(lr, weight_decay=cfg.weight_decay or None)
    return keras.optimizers.SGD(lr, momentum=0.9, weight_decay=cfg.weight_decay or None)


def prepare_run_dir(run_dir, run_config: dict,
                    strategy: tf.distribute.Strategy | None = None) -> pathlib.Path:
    """Writes run_config.json; a leftover backup of a *different* run is discarded.

    A preempted run restarted with the same command resumes from its backup;
    a backup left by a run with another configuration must not be restored
    into this one.  Only the chief (`is_chief(strategy)`; without `strategy`,
    TF_CONFIG decides) writes or discards anything; `train` makes the other
    workers wait for the chief before they read the backup.
    """
    run_dir = pathlib.Path(run_dir)
    if not is_chief(strategy):
        return run_dir
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
    write_json(config_path, run_config)
    return run_dir


TMP_PREFIX = ".tmp_"


def make_deterministic(seed: int) -> None:
    """Deterministic kernels, one op at a time, and seeded Python/NumPy/TF/Keras RNGs (process-wide).

    Call it before building the model so that the initial weights (and the
    dropout seed generators) are the same in every run of the same command;
    call it (or `serialize_op_scheduling`) before TensorFlow runs its first op
    so that the op schedule is fixed too.
    """
    tf.config.experimental.enable_op_determinism()
    serialize_op_scheduling()
    keras.utils.set_random_seed(seed)


def serialize_op_scheduling() -> bool:
    """One inter-op thread: a traced step runs its ops one at a time (each kernel still uses every core).

    Op determinism alone did not make graph-mode training repeatable: with
    independent ops running side by side, the dual path's text-CNN gradients
    differed in the last bits in about half of repeated 15-step runs from the
    same weights and batches (none with one inter-op thread; BUILD_NOTES,
    session 21). TensorFlow fixes the thread count when its runtime starts, so
    this must run before the first op; later it logs what to do and returns False.
    """
    if (tf.config.threading.get_inter_op_parallelism_threads() == 1
            or os.environ.get("TF_NUM_INTEROP_THREADS", "").strip() == "1"):   # read at start-up
        return True
    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        logging.log_first_n(
            logging.WARNING,
            "deterministic ops are on, but TensorFlow already runs independent ops side by side, "
            "which can change the last bits of a step; make the run deterministic before "
            "TensorFlow's first op (tf_twobranch.training.trainer.make_deterministic) or set "
            "TF_NUM_INTEROP_THREADS=1", 1)
        return False
    return True


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: pathlib.Path, write) -> pathlib.Path:
    """`write(tmp)` into a temp file beside `path` (same suffix), fsync, rename over `path`."""
    tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}_{path.name}"  # keeps e.g. the .weights.h5 suffix
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def save_weights_atomic(model: keras.Model, path) -> pathlib.Path:
    """Writes `model.save_weights` to a temp file beside `path`, then renames it.

    A process killed mid-write leaves at most a `.tmp_*` file; `path` is
    either the previous complete file or the new complete one.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_atomic(path, model.save_weights)


def copy_file_atomic(src, dst) -> pathlib.Path:
    """Copies `src` to `dst` through a temp file in `dst`'s directory and a rename."""
    return _write_atomic(pathlib.Path(dst), lambda tmp: shutil.copyfile(src, tmp))


def remove_stale_temp_files(directory) -> None:
    """Deletes `.tmp_*` files a killed process left behind."""
    directory = pathlib.Path(directory)
    if directory.is_dir():
        for stale in directory.glob(f"{TMP_PREFIX}*"):
            stale.unlink(missing_ok=True)


def weights_are_finite(model: keras.Model) -> bool:
    """True when no trainable weight is NaN or infinite."""
    return all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in model.trainable_variables)


def _float_log(logs, key="loss"):
    if not logs or key not in logs:
        return None
    return float(np.asarray(logs[key]))


class NonFiniteLossGuard(keras.callbacks.Callback):
    """Stops training at the first batch whose loss is NaN or infinite.

    Unlike `keras.callbacks.TerminateOnNaN` it records where it happened, and
    the checkpoint/backup callbacks of `train` consult it so that weights
    updated with a non-finite loss are never written over the last good ones.
    Put it first in the callback list.
    """

    def __init__(self, steps_per_epoch: int, first_batch: int = 0):
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.first_batch = first_batch  # batch offset of a resumed, partial epoch
        self.failure: dict | None = None
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.first_batch = 0

    def on_train_batch_end(self, batch, logs=None):
        loss = _float_log(logs)
        if loss is not None and not np.isfinite(loss) and self.failure is None:
            self.failure = {"epoch": self._epoch + 1,                      # 1-based
                            "batch": self.first_batch + batch + 1,        # 1-based in the epoch
                            "loss": loss}
            self.model.stop_training = True

    def ok(self) -> bool:
        return self.failure is None


class _AtomicEpochCheckpoint(keras.callbacks.Callback):
    """Writes weights each epoch to a temp file then renames it (never half-written)."""

    def __init__(self, directory: pathlib.Path, keep: int = 3,
                 guard: NonFiniteLossGuard | None = None):
        super().__init__()
        self.directory = directory
        self.keep = keep
        self.guard = guard

    def on_epoch_end(self, epoch, logs=None):
        if self.guard is not None and not self.guard.ok():
            return  # the weights of this epoch are not good; keep the last good ones
        if not weights_are_finite(self.model):
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = save_weights_atomic(self.model, self.directory / f"epoch_{epoch + 1:04d}.weights.h5")
        copy_file_atomic(path, self.directory / "latest.weights.h5")
        epochs = sorted(self.directory.glob("epoch_*.weights.h5"))
        for old in epochs[:-self.keep]:
            old.unlink()


class TrainingBackup(keras.callbacks.Callback):
    """Backup of one `train()` call, restorable at the exact step (preemption safety).

    Keras 3's `BackupAndRestore` restores the weights but restarts the
    interrupted epoch from its first batch (and with the data stream at step
    0), and does not save the dropout seed generators' state; so a resumed
    run differs from an uninterrupted one. This backup stores, atomically:

      <directory>/step_XXXXXXXXX.weights.h5  weights + optimizer state (Adam moments,
                                             iterations, learning rate)
      <directory>/state.json                 epoch, batch within it, step of the call,
                                             seed generator states, loss-metric state,
                                             per-epoch history; names the weights file

    `state.json` is replaced only after its weights file is complete, and the
    previous weights file is deleted only after that, so a kill at any point
    leaves a consistent backup. Nothing is saved once `guard` saw a
    non-finite loss, or when the weights are not finite.
    """

    def __init__(self, directory: pathlib.Path, *, steps_per_epoch: int, initial_epoch: int,
                 epochs: int, every_steps: int = 0, guard: NonFiniteLossGuard | None = None,
                 restore_directory: pathlib.Path | None = None):
        super().__init__()
        self.directory = pathlib.Path(directory)
        # Where `restore` reads: the chief's backup, also for the other
        # workers of a multi-worker run (they write `directory`, a temp dir).
        self.restore_directory = pathlib.Path(restore_directory or directory)
        self.steps_per_epoch = steps_per_epoch
        self.initial_epoch = initial_epoch
        self.epochs = epochs
        self.every_steps = every_steps
        self.guard = guard
        self.history: dict[str, list] = {}
        self.first_batch = 0          # batch offset of the current (partial) epoch
        self.restored_metrics = None  # loss-metric state to restore at the next epoch begin
        self._epoch = initial_epoch
        self.last_saved: dict | None = None

    @property
    def state_path(self) -> pathlib.Path:
        return self.directory / "state.json"

    def read_state(self) -> dict | None:
        """The state of the backup to restore from (None: there is none)."""
        path = self.restore_directory / "state.json"
        if self.restore_directory == self.directory:
            remove_stale_temp_files(self.directory)  # only the writer may delete them
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise UserInputError(f"{path}: unreadable training backup ({e}); delete "
                                 f"{self.restore_directory} to start this run afresh") from None

    # --- restore -------------------------------------------------------------------
    def restore(self, model: keras.Model, state: dict | None = ...) -> dict | None:
        """Loads the backup into `model` (built, with its optimizer); returns its state.

        `state`: what `read_state` returned, when the caller has read it already.
        """
        if state is ...:
            state = self.read_state()
        if state is None:
            return None
        state_path = self.restore_directory / "state.json"
        expected = {"steps_per_epoch": self.steps_per_epoch,
                    "initial_epoch": self.initial_epoch, "epochs": self.epochs}
        if any(state.get(k) != v for k, v in expected.items()):
            raise UserInputError(
                f"{state_path}: the backup was written by a run with "
                f"{ {k: state.get(k) for k in expected} }, this run has {expected}; delete "
                f"{self.restore_directory} to start afresh or rerun with the original settings")
        weights = self.restore_directory / state["weights"]
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        load_checkpoint(model, weights)
        seeds = _seed_generator_states(model)
        if len(seeds) != len(state["seed_generators"]):
            raise UserInputError(f"{state_path}: the backup has "
                                 f"{len(state['seed_generators'])} random seed generators, the "
                                 f"model {len(seeds)}; it belongs to another model")
        for var, value in zip(seeds, state["seed_generators"]):
            var.assign(np.asarray(value, dtype=var.dtype))
        iterations = int(model.optimizer.iterations.numpy())
        if iterations != state["optimizer_iterations"]:
            raise UserInputError(f"{weights}: optimizer step {iterations} does not match "
                                 f"{state_path} ({state['optimizer_iterations']})")
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.restored_metrics = state["metrics"] if state["batch"] else None
        self.last_saved = state
        return state

    # --- save ----------------------------------------------------------------------
    def _save(self, epoch: int, batch: int) -> None:
        """Backs up the state after `batch` batches of 0-based `epoch`."""
        if (self.guard is not None and not self.guard.ok()) or not weights_are_finite(self.model):
            return
        if batch == self.steps_per_epoch:
            epoch, batch = epoch + 1, 0
        call_step = (epoch - self.initial_epoch) * self.steps_per_epoch + batch
        name = f"step_{call_step:09d}.weights.h5"
        save_weights_atomic(self.model, self.directory / name)
        state = {
            "epoch": epoch, "batch": batch, "call_step": call_step,
            "steps_per_epoch": self.steps_per_epoch, "initial_epoch": self.initial_epoch,
            "epochs": self.epochs,
            "optimizer_iterations": int(self.model.optimizer.iterations.numpy()),
            "weights": name,
            "seed_generators": [v.numpy().tolist() for v in _seed_generator_states(self.model)],
            "metrics": [[v.numpy().tolist() for v in m.variables] for m in self.model.metrics],
            "history": self.history,
        }
        write_json(self.state_path, state)
        for old in self.directory.glob("step_*.weights.h5"):
            if old.name != name:
                old.unlink(missing_ok=True)
        self.last_saved = state

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.restored_metrics is not None:
            # fit() has just reset the metrics; the resumed epoch continues
            # the loss average of its first part.
            for metric, values in zip(self.model.metrics, self.restored_metrics):
                for var, value in zip(metric.variables, values):
                    # A sum-aggregated (on-read) metric variable assigned here, in
                    # cross-replica context, is split over all replicas of the
                    # cluster by TF, so its (summing) read gives `value` back.
                    var.assign(np.asarray(value, dtype=var.dtype))
            self.restored_metrics = None

    def on_train_batch_end(self, batch, logs=None):
        done = self.first_batch + batch + 1
        if self.every_steps and done < self.steps_per_epoch:
            call_step = (self._epoch - self.initial_epoch) * self.steps_per_epoch + done
            if call_step % self.every_steps == 0:
                self._save(self._epoch, done)

    def on_epoch_end(self, epoch, logs=None):
        self.first_batch = 0
        if self.guard is not None and not self.guard.ok():
            return
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(np.asarray(value)))
        self._save(epoch, self.steps_per_epoch)

    def delete(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        parent = self.directory.parent
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def _seed_generator_states(model: keras.Model) -> list:
    # Dropout draws its masks from SeedGenerator state variables, which
    # `save_weights` does not store; a resumed run must continue them.
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


def _dataset_at(dataset, step: int, multi_worker_strategy=None):
    """The training stream from `step` (counted from the start of this train() call).

    With `multi_worker_strategy`, a plain `tf.data.Dataset` is a stream of
    global batches that every worker builds in full and splits by replica
    (no per-worker auto-sharding, which would give each worker other batches).
    """
    if isinstance(dataset, tf.data.Dataset):
        # Runs the pipeline over the skipped batches; a factory can do better.
        ds = dataset.skip(step) if step else dataset
    elif callable(dataset):
        ds = dataset(step)
    else:
        raise ConfigError(f"train() needs a tf.data.Dataset or a function start_step -> "
                          f"Dataset, got {type(dataset).__name__}")
    if multi_worker_strategy is not None and isinstance(ds, tf.data.Dataset):
        ds = distribute_global_batches(multi_worker_strategy, lambda: ds)
    return without_autotuning(ds) if isinstance(ds, tf.data.Dataset) else ds


@reports_fit(model_params)
def train(model: keras.Model, dataset, cfg: TrainConfig, run_dir,
          *, steps_per_epoch: int, extra_callbacks=(), initial_epoch: int = 0,
          epochs: int | None = None) -> keras.callbacks.History:
    """Fits `model` on an infinite dataset with checkpoints, backup and logs.

    `dataset` is an infinite `tf.data.Dataset` whose element i is the batch of
    step i of this call, or a function `start_step -> Dataset` giving the
    stream from `start_step` on (cheaper to resume than `Dataset.skip`).

    Preemption: a run killed at any point (even SIGKILL mid-epoch) and started
    again with the same command resumes from the last backup (every
    `cfg.backup_every_steps` steps and at each epoch end) at the exact step:
    weights, optimizer state, dropout seed state, the data stream and the
    epoch's running loss continue where the backup was taken, so with
    `cfg.deterministic` the final weights equal an uninterrupted run's.
    A completed call deletes its backup. The returned History covers all
    epochs of the call (also those before a resume) and has `resumed_from`.

    Raises `UserInputError` when the loss becomes NaN/infinite; the last good
    checkpoint and the backup are kept, and the message names them.

    Under a multi-worker strategy (see the module docstring) only the chief
    writes `run_dir`; the others write a temporary directory deleted on
    return.  A plain `tf.data.Dataset` (or a factory returning one) is then
    taken as the stream of *global* batches: every worker builds it and takes
    its replicas' rows (`distribute.distribute_global_batches`), instead of
    Keras' per-worker auto-sharding.
    """
    cfg.validate()
    strategy = model.distribute_strategy
    multi_worker = is_multi_worker(strategy)
    chief = is_chief(strategy)
    run_dir = pathlib.Path(run_dir)
    if chief:
        run_dir.mkdir(parents=True, exist_ok=True)
        return _train(model, dataset, cfg, run_dir, run_dir, strategy, multi_worker,
                      steps_per_epoch=steps_per_epoch, extra_callbacks=extra_callbacks,
                      initial_epoch=initial_epoch, epochs=epochs)
    resolver = cluster_resolver(strategy)
    write_dir = pathlib.Path(tempfile.mkdtemp(
        prefix=f"tf_twobranch_{resolver.task_type}{resolver.task_id}_"))
    try:
        return _train(model, dataset, cfg, run_dir, write_dir, strategy, multi_worker,
                      steps_per_epoch=steps_per_epoch, extra_callbacks=extra_callbacks,
                      initial_epoch=initial_epoch, epochs=epochs)
    finally:
        shutil.rmtree(write_dir, ignore_errors=True)


def _train(model, dataset, cfg: TrainConfig, run_dir: pathlib.Path, write_dir: pathlib.Path,
           strategy, multi_worker: bool, *, steps_per_epoch: int, extra_callbacks,
           initial_epoch: int, epochs: int | None) -> keras.callbacks.History:
    end_epoch = epochs or cfg.epochs
    if cfg.deterministic:
        make_deterministic(cfg.seed)
    checkpoint_dir = write_dir / "checkpoints"
    remove_stale_temp_files(checkpoint_dir)
    if getattr(model, "optimizer", None) is None or not model.compiled:
        # jit_compile explicit: Keras' default 'auto' turns XLA on wherever a GPU is visible.
        model.compile(optimizer=make_optimizer(cfg, steps_per_epoch), jit_compile=False)
    guard = NonFiniteLossGuard(steps_per_epoch)
    # One backup directory per train() call, so that a multi-stage run does
    # not restore one stage's state into another.
    stage = pathlib.Path("backup") / f"epochs_{initial_epoch:04d}_{end_epoch:04d}"
    backup = TrainingBackup(write_dir / stage, restore_directory=run_dir / stage,
                            steps_per_epoch=steps_per_epoch, initial_epoch=initial_epoch,
                            epochs=end_epoch, every_steps=cfg.backup_every_steps, guard=guard)
    if multi_worker:
        # Barrier: the chief has finished `prepare_run_dir` (which may discard
        # a stale backup) before anyone reads the backup.
        _gather_over_workers(strategy, 0)
    state = backup.read_state()
    if multi_worker:
        steps = _gather_over_workers(strategy, -1 if state is None else state["call_step"])
        if len(set(steps)) > 1:
            raise UserInputError(
                f"{backup.restore_directory}: the workers found different backups to resume "
                f"from (steps {steps}, -1 = none); is {run_dir} on a filesystem every worker "
                f"sees? Delete it to start afresh")
    state = backup.restore(model, state)
    start_epoch, start_batch = initial_epoch, 0
    if state is not None:
        start_epoch, start_batch = state["epoch"], state["batch"]
        logging.info("%s: resuming from the backup at epoch %d, batch %d (step %d of this stage)",
                     run_dir, start_epoch + 1, start_batch, state["call_step"])
    callbacks = [
        guard,
        # The epoch checkpoint before the backup: a kill between the two
        # redoes the epoch rather than skipping its checkpoint.
        _AtomicEpochCheckpoint(checkpoint_dir, guard=guard),
        backup,
        keras.callbacks.TensorBoard(str(write_dir / "logs"), update_freq="epoch",
                                    write_graph=False),
        *extra_callbacks,
    ]
    # A resumed mid-epoch backup first finishes its epoch with a shorter fit.
    segments = []
    if start_batch:
        segments.append((start_epoch, start_epoch + 1, steps_per_epoch - start_batch, start_batch))
        start_epoch += 1
    if start_epoch < end_epoch:
        segments.append((start_epoch, end_epoch, steps_per_epoch, 0))
    last = None
    for first, stop, steps, first_batch in segments:
        guard.first_batch = backup.first_batch = first_batch
        call_step = (first - initial_epoch) * steps_per_epoch + first_batch
        last = model.fit(_dataset_at(dataset, call_step, strategy if multi_worker else None),
                         epochs=stop, steps_per_epoch=steps,
                         initial_epoch=first, callbacks=callbacks, verbose=cfg.verbose,
                         shuffle=False)  # the tf.data stream shuffles; Keras warns on a Dataset with True
        if not guard.ok():
            break
    if not guard.ok():
        # Named as the chief wrote them (a non-chief's own copies are temporary).
        raise UserInputError(_non_finite_message(guard.failure, steps_per_epoch, initial_epoch,
                                                 run_dir / "checkpoints", backup))
    backup.delete()
    history = keras.callbacks.History()
    history.set_model(model)
    history.history = dict(backup.history)
    done = max((len(v) for v in history.history.values()), default=0)
    history.epoch = list(range(end_epoch - done, end_epoch))
    history.params = last.params if last is not None else {}
    # Where this call resumed from (None: a fresh start), for logs and tests.
    history.resumed_from = (None if state is None else
                            {k: state[k] for k in ("epoch", "batch", "call_step")})
    return history


def _non_finite_message(failure: dict, steps_per_epoch: int, initial_epoch: int,
                        checkpoint_dir: pathlib.Path, backup: TrainingBackup) -> str:
    step = (failure["epoch"] - 1 - initial_epoch) * steps_per_epoch + failure["batch"]
    latest = checkpoint_dir / "latest.weights.h5"
    if latest.exists():
        good = f"the last good checkpoint is {latest}"
        epochs = sorted(checkpoint_dir.glob("epoch_*.weights.h5"))
        if epochs:
            good += f" (= {epochs[-1].name})"
    else:
        good = f"no epoch checkpoint was written yet ({checkpoint_dir} has none)"
    if backup.last_saved is not None:
        good += (f"; the backup {backup.restore_directory / backup.last_saved['weights']} "
                 f"(step {backup.last_saved['call_step']}) was kept")
    return (f"training stopped: the loss became {failure['loss']} at epoch {failure['epoch']}, "
            f"batch {failure['batch']}/{steps_per_epoch} (step {step} of this stage); {good}. "
            f"Check the input features for NaN or extreme values, or lower the learning rate "
            f"and run again")
