"""Typed row recipes: an experiment's flag values as a dataclass.

An experiment builds its recipe once from its flags (after its profile
defaults are applied), passes it to its pipeline (`load_data(recipe)`,
`build_config(recipe, ...)`, ...) and stores it in ``results.json["recipe"]``
and each stage's ``run_config.json["recipe"]``; `Recipe.from_record` reads it
back without absl, so a finished run's data is rebuilt from its folder alone.
A recipe's fields are the experiment's flags, with the same names and
defaults (each family's tests check that they agree).
"""
from __future__ import annotations

import dataclasses
import re
from typing import TypeVar

from tf_twobranch.errors import ConfigError, UserInputError

__all__ = ["Recipe", "slug"]

RecipeT = TypeVar("RecipeT", bound="Recipe")


class Recipe:
    """Base of the families' recipe dataclasses (JSON-serialisable values)."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls: type[RecipeT], values: dict, *, strict: bool = True) -> RecipeT:
        """The recipe of `values`; a name that is not a field is an error (`strict`) or skipped.
        A list given for a field whose default is a tuple becomes a tuple (JSON has no tuples)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown and strict:
            raise ConfigError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) and isinstance(fields[k].default, tuple) else v
                      for k, v in values.items() if k in fields})

    @classmethod
    def from_flags(cls: type[RecipeT], fv) -> RecipeT:
        """The recipe of parsed flags (an absl FlagValues, or anything indexable by flag name)."""
        return cls.from_dict({name: fv[name].value for name in cls.field_names()})

    @classmethod
    def from_record(cls: type[RecipeT], record: dict, where: str = "the run record") -> RecipeT:
        """The recipe of a results.json or run_config.json record.

        ``record["recipe"]``; in records written before recipes, the effective
        flag values ``record["flags"]`` (names that are no field are skipped,
        fields they lack keep their defaults).
        """
        if isinstance(record.get("recipe"), dict):
            return cls.from_dict(record["recipe"])
        if isinstance(record.get("flags"), dict):
            return cls.from_dict(record["flags"], strict=False)
        raise UserInputError(f"{where}: no 'recipe' (or 'flags') entry to rebuild the run's data from")


def slug(text: str) -> str:
    """A file-system friendly name (a table row's run folder, a cache file)."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "run"
