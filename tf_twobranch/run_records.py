"""What every family's pipeline does the same way: seeding and strategy, the trainer's
configuration, the run record of a recipe, and writing results (the chief only)."""
from __future__ import annotations

import keras

from tf_twobranch import distribute, json_files
from tf_twobranch.recipes import Recipe, as_record
from tf_twobranch.speed import set_precision
from tf_twobranch.training import trainer


def setup_training(r):
    """Applies a recipe's run fields before a model is built; returns the strategy.

    Seeds every generator (`seed`; with `deterministic` also deterministic TF
    ops), sets the dtype policy (`precision`) and creates the `tf.distribute`
    strategy (`strategy`).
    """
    keras.utils.set_random_seed(r.seed)
    if r.deterministic:
        trainer.make_deterministic(r.seed)
    set_precision(r.precision)
    return distribute.get_strategy(r.strategy)


def train_config(r, *, epochs: int, learning_rate: float, seed: int | None = None, **overrides):
    """The trainer's configuration from a recipe's run fields (strategy, verbosity, backups, determinism)."""
    tcfg = trainer.TrainConfig(epochs=epochs, learning_rate=learning_rate,
                               seed=r.seed if seed is None else seed, strategy=r.strategy,
                               verbose=r.verbose, backup_every_steps=r.backup_every_steps,
                               deterministic=r.deterministic, **overrides)
    tcfg.validate()
    return tcfg


def run_record(r, typed: dict | None = None) -> dict:
    """``{"typed_flags": what the user set, "flags": every effective value, "recipe": the recipe}``.

    `r`: a recipe (or, for the experiments not converted yet, absl FlagValues).
    """
    if isinstance(r, Recipe):
        return {"typed_flags": dict(typed or {}), "flags": r.to_dict(), "recipe": as_record(r)}
    from tf_twobranch.recipes import typed_flags
    return {"typed_flags": typed_flags(r) if typed is None else typed, "flags": r.flag_values_dict()}


def is_chief() -> bool:
    """True unless this process is a non-chief worker of a multi-worker run (TF_CONFIG)."""
    return distribute.is_chief()


def write_results(path, payload) -> None:
    """Under MultiWorkerMirroredStrategy every worker computes the same results; only the chief
    writes them (the run folder is shared)."""
    if is_chief():
        json_files.write_json(path, payload)
