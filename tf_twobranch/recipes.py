"""Typed row recipes: what one table row runs, as a dataclass instead of absl `FlagValues`.

Each experiment turns its flags into its recipe once, in its entry point
(`from_flags(RecipeClass, FlagValues)`); the library pipelines
(`tf_twobranch.systems.*.pipeline`) take the recipe, never `FlagValues`. A recipe's
fields are exactly its experiment's flag names (`tests/apps/test_recipes.py`), so a
recipe is also what a notebook user writes instead of a flagfile::

    from tf_twobranch.systems.two_branch import pipeline
    record = pipeline.run(pipeline.RetrievalRecipe(row_name="mine", epochs=2))

`results.json` stores the recipe (`"recipe"`, see `as_record`).

`--smoke` (every experiment) caps a row's training length and data so that
it runs in seconds: each recipe class declares its caps (``SMOKE_CAPS``, beside
its fields in its system's pipeline), `apply_smoke(recipe)` applies them (a cap
only ever shortens: a stage switched off stays off).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Sequence, TypeVar

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.features import SCENE_CNN_EPOCHS

R = TypeVar("R", bound="Recipe")

SMOKE_HELP = "Run the row in seconds (a check that it runs, not a result): caps its training length and data."


def flag(default: Any = dataclasses.MISSING, help: str = "", *,  # noqa: A002  (absl's word)
         enum: Sequence[str] | None = None, lower_bound: float | None = None, upper_bound: float | None = None,
         default_factory: Any = dataclasses.MISSING) -> Any:
    """A recipe field that is also its experiment's flag: its default, help, choices and bounds,
    declared once; `define_recipe_flags` defines the flag from it."""
    spec = {"help": help, "enum": None if enum is None else tuple(enum), "lower_bound": lower_bound,
            "upper_bound": upper_bound}
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"flag": spec})


# Fields several systems' recipes share, each declared here once (a `dataclasses.Field` cannot
# belong to two classes: each recipe calls the factory).
DEFAULT_CAPTION_FORMATS = ("auto", "karpathy", "token", "coco")


def caption_format_field(formats: Sequence[str] = DEFAULT_CAPTION_FORMATS) -> Any:
    return flag("auto", "Caption file layout of --dataset_dir.", enum=formats)


def images_dir_field() -> Any:
    return flag("", "Images folder (default <dataset_dir>/images, <dataset_dir>/flickr30k-images or <dataset_dir>).")


def max_images_field(split: str) -> Any:
    """--max_train_images (`split` "training") or --max_test_images ("test")."""
    return flag(0, f"Use only the first N {split} images (0 = all).", lower_bound=0)


def eval_split_field() -> Any:
    return flag("test", "Split to evaluate on.", enum=("val", "test"))


def word_vectors_field() -> Any:
    return flag("", "Local word2vec (binary/text, e.g. GoogleNews .bin) or GloVe text file; empty: trained on the "
                "training captions.")


def backbone_weights_field() -> Any:
    return flag("", "Local ImageNet weights file of the backbone.")


def feature_dtype_field() -> Any:
    return flag("float32", "Storage dtype of feature caches: float16 halves disk and RAM for large datasets (rows "
                "are cast back to float32 in each batch).", enum=("float32", "float16"))


def momentum_field() -> Any:
    return flag(0.9, "SGD momentum.", lower_bound=0.0, upper_bound=1.0)


def scene_cnn_epochs_field() -> Any:
    return flag(SCENE_CNN_EPOCHS, "Epochs of the scene_cnn backbone trained on the training images and captions.",
                lower_bound=1)


def paper_dataset_field(default: str) -> Any:
    return flag(default, "Dataset of the paper numbers.")


# The table runner's --runs_dir and --resume (`tf_twobranch.table_runner`), as a recipe's fields or,
# for a runner that is no row, as plain flags (`experiments.common.define_runner_flags`).
RUNS_DIR_HELP = "Parent folder of the rows' run folders, each named after its flagfile (default runs/ in the repository)."
RESUME_HELP = ("Reuse rows that finished earlier with the same arguments (<run folder>/results.json and "
               "table_row.json); --noresume runs them again.")


def runs_dir_field() -> Any:
    return flag("", RUNS_DIR_HELP)


def resume_field() -> Any:
    return flag(True, RESUME_HELP)


@dataclasses.dataclass
class Recipe:
    """Base of every row recipe: each field is one flag of the experiment (`flag`), defined by
    `define_recipe_flags`; ``FLAG_HELP`` words a shared field's help for one experiment."""

    FLAG_HELP: ClassVar[dict[str, str]] = {}
    # What --smoke caps (`apply_smoke`): field -> the largest value a smoke run keeps.
    SMOKE_CAPS: ClassVar[dict[str, Any]] = {}
    # Flags that exclude each other (a validator is registered for each pair).
    EXCLUSIVE_FLAGS: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def flag_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def field_names(cls) -> list[str]:
        """The fields in declaration order (the order the experiment defines its flags)."""
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls: type[R], values: dict, *, strict: bool = True) -> R:
        """The recipe of `values`; a name that is not a field is an error (`strict`) or skipped.
        A list given for a field whose default is a tuple becomes a tuple (JSON has no tuples)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields) - {"type"})
        if unknown and strict:
            raise ConfigError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) and isinstance(fields[k].default, tuple) else v
                      for k, v in values.items() if k in fields})

    @classmethod
    def from_flags(cls: type[R], fv) -> R:
        """The recipe of parsed flags (`fv`: absl FlagValues, or any mapping-like with `fv[name].value`).

        Every field must be a flag of `fv`; list flags are copied (a list for a field whose
        default is a tuple becomes a tuple, as in `from_dict`).
        """
        missing = sorted(n for n in cls.flag_names() if n not in fv)
        if missing:
            raise ValueError(f"{cls.__name__}: no flag for the fields {missing}")
        values = {}
        for name in cls.field_names():
            value = fv[name].value
            values[name] = list(value) if isinstance(value, (list, tuple)) else value
        return cls.from_dict(values)

    @classmethod
    def from_record(cls: type[R], record: dict, where: str = "the run record") -> R:
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

    def replace(self: R, **changes) -> R:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class RunRecipe(Recipe):
    """The flags every training experiment shares."""
    EXCLUSIVE_FLAGS = (("jit_compile", "run_eagerly"),)
    strategy: str = flag(
        "default", "tf.distribute strategy.", enum=("default", "mirrored", "multi_worker", "tpu"))
    precision: str = flag(
        "float32", "Compute precision of the towers (variables and losses stay float32); mixed_bfloat16 on "
        "CPU/GPU, mixed_float16 on GPU only.", enum=("float32", "mixed_bfloat16", "mixed_float16"))
    jit_compile: bool = flag(False, "XLA-compile the whole training step.")
    run_eagerly: bool = flag(
        False, "Run the training step eagerly: for debugging, and for runs of a few steps, where tracing a "
        "large graph costs more than the steps.")
    seed: int = flag(0, "Seed of every random choice.")
    backup_every_steps: int = flag(
        0, "Preemption backup every this many training steps within an epoch (0 = at epoch ends only); a "
        "run restarted with the same command resumes at the backed-up step.")
    deterministic: bool = flag(
        False, "Deterministic TF kernels, one op at a time and seeded RNGs (the same command gives the same "
        "weights, and a resumed run ends with the weights of an uninterrupted one; slower on GPU).")
    export: bool = flag(True, "Write a SavedModel to <run_dir>/export.")
    verbose: int = flag(1, "Keras progress bar (0 = silent).")
    run_dir: str = flag("", "Run directory (default runs/<row_name>).")
    row_name: str = flag("", "Name of the table row.")
    paper_results: str = flag("", "The paper's six numbers for this row (i2t R@1,5,10, t2i R@1,5,10).")
    paper_protocol: str = flag(
        "", "Protocol the paper's retrieval numbers were measured under (each flagfile declares it); they "
        "are printed only beside a result of the same protocol.",
        enum=("", "full", "flickr30k_1k", "flickr8k_1k", "coco_1k", "coco_5k", "first_caption", "folds_100"))
    out_json: str = flag("", "Results JSON (default <run_dir>/results.json).")
    smoke: bool = flag(False, SMOKE_HELP)


def from_flags(cls: type[R], fv) -> R:
    """`cls.from_flags(fv)` (`Recipe.from_flags`)."""
    return cls.from_flags(fv)


def define_recipe_flags(cls: type[Recipe], fv) -> None:
    """Defines one absl flag per field of the recipe class `cls` (into FlagValues `fv`), from the
    field's type, default and `flag` metadata: a ``str`` field with choices is an enum flag, a
    ``list`` field a comma-separated list."""
    from absl import flags

    d = dict(flag_values=fv)
    for field in dataclasses.fields(cls):
        spec = field.metadata.get("flag")
        if spec is None:
            raise ConfigError(f"{cls.__name__}.{field.name}: a recipe field is declared with recipes.flag(...)")
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        help_text = cls.FLAG_HELP.get(field.name, spec["help"])
        if field.name == "smoke":
            help_text = smoke_help(cls.SMOKE_CAPS)
        bounds = {k: spec[k] for k in ("lower_bound", "upper_bound") if spec[k] is not None}
        kind = field.type if isinstance(field.type, str) else field.type.__name__
        if spec["enum"] is not None:
            flags.DEFINE_enum(field.name, default, list(spec["enum"]), help_text, **d)
        elif kind == "bool":
            flags.DEFINE_bool(field.name, default, help_text, **d)
        elif kind == "int":
            flags.DEFINE_integer(field.name, default, help_text, **bounds, **d)
        elif kind == "float":
            flags.DEFINE_float(field.name, default, help_text, **bounds, **d)
        elif kind == "str":
            flags.DEFINE_string(field.name, default, help_text, **d)
        elif kind.startswith(("list", "tuple")):
            flags.DEFINE_list(field.name, list(default), help_text, **d)
        else:
            raise ConfigError(f"{cls.__name__}.{field.name}: no flag for a field of type {kind}")
    for first, second in cls.EXCLUSIVE_FLAGS:
        flags.register_multi_flags_validator(
            [first, second], lambda v, a=first, b=second: not (v[a] and v[b]),
            f"--{first} and --{second} exclude each other.", flag_values=fv)


def typed_flags(fv) -> dict:
    """The flags the user set (command line or flagfile), before any default profile."""
    return {name: fv[name].value for name in fv if fv[name].present}


def as_record(recipe: Recipe) -> dict:
    """The recipe as results.json stores it: its type and its values."""
    return {"type": type(recipe).__name__, **recipe.to_dict()}


def apply_profile(recipe: R, typed: Mapping[str, Any], profile: Mapping[str, Any]) -> tuple[R, dict]:
    """A profile's values for the fields the user did not set, when no dataset folder is given.

    Returns (the recipe, what was applied). The embedded digit scenes are much
    smaller than the papers' datasets; each experiment declares the defaults
    that suit them.
    """
    if getattr(recipe, "dataset_dir", ""):
        return recipe, {}
    applied = {k: v for k, v in profile.items() if k not in typed}
    return dataclasses.replace(recipe, **applied), applied


def prepare_recipe(recipe: R, typed: Mapping[str, Any], profile: Mapping[str, Any]) -> tuple[R, dict]:
    """The row's recipe with the embedded profile (`apply_profile`) and then --smoke
    (`apply_smoke`) applied, each logged; returns it and what the two changed."""
    from absl import logging
    recipe, applied = apply_profile(recipe, typed, profile)
    if applied:
        logging.info("embedded dataset: using its profile defaults %s", applied)
    recipe, smoke = apply_smoke(recipe)
    if smoke:
        logging.info("--smoke: %s", smoke)
    return recipe, {**applied, **smoke}


# --------------------------------------------------------------------------- --smoke

# Fields whose 0 means "all" get the cap when 0.
_ZERO_MEANS_ALL = ("max_train_images", "max_test_images", "max_proposals", "steps_per_epoch")


def smoke_help(caps: Mapping[str, Any]) -> str:
    """The --smoke help of an experiment whose --smoke applies `caps` (a recipe's ``SMOKE_CAPS``)."""
    if not caps:
        return SMOKE_HELP
    listed = ", ".join(f"--{name}<={value}" for name, value in caps.items())
    return f"{SMOKE_HELP[:-1]} (at most {listed}; a 0 that means all gets the cap)."


def define_smoke_flag(fv, caps: Mapping[str, Any] | None = None) -> None:
    """--smoke for an experiment that has no recipe of its own (`smoke_help(caps)`); kept here
    so tools that import no TensorFlow at start-up can define it too."""
    from absl import flags
    flags.DEFINE_bool("smoke", False, smoke_help(caps or {}), flag_values=fv)


def capped(name: str, value, cap):
    """`value` shortened to `cap` (never lengthened; 0 stays 0 except where 0 means "all")."""
    if name in _ZERO_MEANS_ALL:
        return cap if not value or value > cap else value
    return min(value, cap)


def apply_smoke(recipe: R) -> tuple[R, dict]:
    """The recipe with its class's --smoke caps (``SMOKE_CAPS``) applied when `recipe.smoke` (else
    unchanged); returns it and what changed."""
    if not getattr(recipe, "smoke", False):
        return recipe, {}
    caps = type(recipe).SMOKE_CAPS
    if not caps:
        raise ConfigError(f"{type(recipe).__name__} declares no SMOKE_CAPS: --smoke cannot shorten its rows")
    changes = {name: capped(name, getattr(recipe, name), cap) for name, cap in caps.items()}
    changes = {k: v for k, v in changes.items() if v != getattr(recipe, k)}
    return dataclasses.replace(recipe, **changes), changes