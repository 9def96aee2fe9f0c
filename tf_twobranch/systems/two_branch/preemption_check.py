"""Checks that a training run killed mid-epoch resumes to the same weights.

Trains a tiny embedding network on deterministic random features through
`trainer.train` (deterministic ops on) and writes its final weights to
`<run_dir>/final_weights.npz`. Run the same command twice — once straight
through, once killed with SIGKILL and started again — and the two weight
files should be identical. `--self_test` does exactly that in `--work_dir`
and prints the largest weight difference:

    python -m tf_twobranch.systems.two_branch.preemption_check --self_test --work_dir /tmp/pc

A single training run (what the self-test starts in subprocesses):

    python -m tf_twobranch.systems.two_branch.preemption_check --run_dir /tmp/pc/run \\
        --epochs 3 --steps_per_epoch 8 --backup_every_steps 2

Use it to check a machine or file system setup (e.g. a network disk for
run directories) before trusting long preemptible runs to it.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.errors import ConfigError

NUM_IMAGES = 64
CAPTIONS_PER_IMAGE = 2
IMAGE_DIM = 16
TEXT_DIM = 12
BATCH_SIZE = 16
WEIGHTS_FILE = "final_weights.npz"

def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("run_dir", None, "Run directory of one training run.", **d)
    flags.DEFINE_integer("epochs", 3, "Epochs.", **d)
    flags.DEFINE_integer("steps_per_epoch", 8, "Steps per epoch.", **d)
    flags.DEFINE_integer("backup_every_steps", 2, "Mid-epoch backup interval (0: epoch ends).", **d)
    flags.DEFINE_integer("seed", 0, "Seed of the features, the initial weights and the batches.", **d)
    flags.DEFINE_float("learning_rate", 1e-2, "Adam learning rate.", **d)
    flags.DEFINE_float("step_delay", 0.0,
                       "Seconds to sleep after each step (gives a killer time to strike mid-epoch).", **d)
    flags.DEFINE_bool("self_test", False, "Run, kill, resume and compare in --work_dir.", **d)
    flags.DEFINE_string("work_dir", None, "Work directory of --self_test.", **d)


def synthetic_features(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image features, text features, caption_image): texts are noisy projections of images."""
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(NUM_IMAGES, IMAGE_DIM)).astype(np.float32)
    caption_image = np.repeat(np.arange(NUM_IMAGES), CAPTIONS_PER_IMAGE)
    projection = rng.normal(size=(IMAGE_DIM, TEXT_DIM)).astype(np.float32)
    text = image[caption_image] @ projection
    text += 0.5 * rng.normal(size=text.shape).astype(np.float32)
    return image, text.astype(np.float32), caption_image


def train_tiny_model(run_dir, *, epochs: int, steps_per_epoch: int, backup_every_steps: int,
                     seed: int = 0, learning_rate: float = 1e-2,
                     step_delay: float = 0.0) -> pathlib.Path:
    """Trains (or resumes) the tiny run in `run_dir`; returns the final weights file."""
    # Keras/TensorFlow only when a run trains: --help and the --self_test parent stay light.
    import keras

    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
    from tf_twobranch.systems.two_branch.sampling import attach_features, image_sentence_batches
    from tf_twobranch.training import trainer

    run_dir = pathlib.Path(run_dir)
    tcfg = trainer.TrainConfig(epochs=epochs, learning_rate=learning_rate, seed=seed, verbose=0,
                               backup_every_steps=backup_every_steps, deterministic=True)
    tcfg.validate()
    trainer.make_deterministic(seed)  # before building: same initial weights every run
    config = TwoBranchConfig(image_dim=IMAGE_DIM, text_dim=TEXT_DIM, image_hidden=(32,),
                             text_hidden=(32,), embed_dim=16, dropout=0.2, top_k=3)
    model = build_model(config)
    image, text, caption_image = synthetic_features(seed)
    trainer.prepare_run_dir(run_dir, {"model": config.to_dict(), "train": tcfg.__dict__,
                                      "task": "preemption_check"})

    def dataset_from(start_step: int):
        # Skipping index batches is cheap; features are gathered afterwards.
        batches = image_sentence_batches(caption_image, NUM_IMAGES, batch_size=BATCH_SIZE,
                                          sample_size=CAPTIONS_PER_IMAGE, seed=seed)
        return attach_features(batches.skip(start_step), image, text)

    callbacks = []
    if step_delay > 0:
        callbacks.append(keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: time.sleep(step_delay)))
    history = trainer.train(model, dataset_from, tcfg, run_dir,
                            steps_per_epoch=steps_per_epoch, extra_callbacks=callbacks)
    print(f"resumed_from={json.dumps(history.resumed_from)}", flush=True)
    weights = {v.path: v.numpy() for v in model.weights}
    weights["optimizer_iterations"] = np.asarray(model.optimizer.iterations.numpy())
    out = run_dir / WEIGHTS_FILE
    tmp = run_dir / f"{trainer.TMP_PREFIX}{os.getpid()}_{WEIGHTS_FILE}"
    with open(tmp, "wb") as f:
        np.savez(f, **weights)
    os.replace(tmp, out)
    return out


def training_command(run_dir, *, epochs: int = 3, steps_per_epoch: int = 8,
                     backup_every_steps: int = 2, step_delay: float = 0.0) -> list[str]:
    """The command line of one training run (the same for the first start and the restart)."""
    return [sys.executable, "-m", "tf_twobranch.systems.two_branch.preemption_check",
            f"--run_dir={run_dir}", f"--epochs={epochs}", f"--steps_per_epoch={steps_per_epoch}",
            f"--backup_every_steps={backup_every_steps}", f"--step_delay={step_delay}"]


def backup_position(run_dir) -> tuple[int, int] | None:
    """(0-based epoch, batches done in it) of the run's current backup, or None."""
    for state_path in pathlib.Path(run_dir).glob("backup/*/state.json"):
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        return state["epoch"], state["batch"]
    return None


def start_and_kill(command: list[str], run_dir, *, kill_epoch: int = 1, env=None,
                   timeout: float = 120.0) -> tuple[int, int]:
    """Starts `command`, SIGKILLs it once a mid-epoch backup of `kill_epoch` exists.

    Returns the backup position at the time of the kill.
    """
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            position = backup_position(run_dir)
            if position is not None and position[0] == kill_epoch and position[1] > 0:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return position
            if proc.poll() is not None:
                raise RuntimeError(f"the training run ended (status {proc.returncode}) before "
                                   f"a mid-epoch backup of epoch {kill_epoch + 1}: "
                                   f"{proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.01)
        raise RuntimeError(f"no mid-epoch backup of epoch {kill_epoch + 1} after {timeout} s")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stderr.close()


def load_weights_file(path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def max_weight_difference(a: dict, b: dict) -> float:
    if set(a) != set(b):
        raise ValueError(f"different variables: {sorted(set(a) ^ set(b))}")
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)),
                            initial=0.0)) for k in a)


def self_test(work_dir, *, epochs: int = 3, steps_per_epoch: int = 8,
              backup_every_steps: int = 2, step_delay: float = 0.2) -> dict:
    """Uninterrupted run vs killed-and-restarted run; returns the comparison."""
    work_dir = pathlib.Path(work_dir)
    straight, resumed = work_dir / "uninterrupted", work_dir / "resumed"
    kwargs = dict(epochs=epochs, steps_per_epoch=steps_per_epoch,
                  backup_every_steps=backup_every_steps)
    subprocess.run(training_command(straight, **kwargs), check=True,
                   stdout=subprocess.DEVNULL)
    command = training_command(resumed, step_delay=step_delay, **kwargs)
    killed_at = start_and_kill(command, resumed, kill_epoch=min(1, epochs - 1))
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    diff = max_weight_difference(load_weights_file(straight / WEIGHTS_FILE),
                                 load_weights_file(resumed / WEIGHTS_FILE))
    return {"killed_at_epoch": killed_at[0] + 1, "killed_after_batch": killed_at[1],
            "max_abs_weight_difference": diff}


def _run() -> None:
    f = flags.FLAGS
    if f.self_test:
        if not f.work_dir:
            raise ConfigError("--self_test needs --work_dir")
        result = self_test(f.work_dir, epochs=f.epochs, steps_per_epoch=f.steps_per_epoch,
                           backup_every_steps=f.backup_every_steps)
        print(json.dumps(result))
        if result["max_abs_weight_difference"] > 1e-6:
            print("FAIL: the resumed run's weights differ from the uninterrupted run's",
                  file=sys.stderr)
            sys.exit(1)
        print("OK: the resumed run ends with the uninterrupted run's weights")
        return
    if not f.run_dir:
        raise ConfigError("--run_dir is required (or --self_test --work_dir DIR)")
    print("final weights:", train_tiny_model(f.run_dir, epochs=f.epochs, steps_per_epoch=f.steps_per_epoch,
                           backup_every_steps=f.backup_every_steps, seed=f.seed,
                           learning_rate=f.learning_rate, step_delay=f.step_delay))


if __name__ == "__main__":
    define_flags()
    app.run(absl_main(_run), flags_parser=parse_flags)
