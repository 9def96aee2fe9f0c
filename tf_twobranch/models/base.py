"""The contract every model family keeps.

Four families live under `tf_twobranch.models`, one per paper:

=====================  =====================================  ==========================
family (`FAMILY`)      paper                                   model module
=====================  =====================================  ==========================
``two_branch``         Wang et al., TPAMI 2018 / CVPR 2016     `models.two_branch`
``dual_path``          Zheng et al., dual-path CNN              `models.dual_path`
``fragment_embedding`` Karpathy, Joulin, Fei-Fei (DeFrag)       `models.fragment_embedding`
``npair_localization`` Das et al., N-pair phrase localization   `models.npair_localization`
=====================  =====================================  ==========================

Each family has

* a configuration dataclass deriving from `ModelConfig`: ``to_dict`` /
  ``from_dict`` (unknown keys are a `ConfigError`), saved beside the weights
  with `save_model_config` and read back with `load_model_config` — the one
  atomic writer (`json_files.write_json`) and the one reader;
* one builder, ``build_<family>_model(config, ...)`` (the two-branch family
  keeps its historical name `build_model`);
* one loss hook, ``objective(batch, training) -> dict`` of loss terms with
  ``"loss"`` the total the trainer minimises;
* ``evaluate(split) -> metrics`` through the one evaluation core
  (`tf_twobranch.evaluation`), where `split` is what the family's
  `runs.Run.evaluation_split()` gives.

`tf_twobranch.runs.load_run` finds a run's family from the configuration
file in its folder (`ModelConfig.FILE_NAME`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, TypeVar

from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.json_files import read_json_object, write_json

__all__ = ["ModelConfig", "save_model_config", "load_model_config"]

ConfigT = TypeVar("ConfigT", bound="ModelConfig")


class ModelConfig:
    """Base of the families' configuration dataclasses (JSON-serialisable)."""

    FAMILY: ClassVar[str] = ""         # the family's name (module docstring)
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
