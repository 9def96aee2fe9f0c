"""The one registry of paper systems: what the run-level apps know of a system.

`load_run`, `export_run`, `gallery_from_model` and the run-folder checks reach a system only
through its `System` here (`get(name)`, `all()`, `for_task(task)`, `for_model(model)`): no
"module:function" strings, no `importlib`, no if-chain on a system's name. A system declares
its `System` in ``tf_twobranch/systems/<name>/system.py``; the four of the package are
registered when `tf_twobranch.systems` is imported, and `register` adds another (a system that
lives in one folder of its own, e.g. a test's).

This module and every ``system.py`` import no TensorFlow: the draw tools read a folder's kind
(`tf_twobranch.run_folders`) before anything heavy loads. A system's callables import what
they need when called.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

from tf_twobranch.errors import ConfigError

__all__ = ["RunTask", "LeaderboardRun", "LeaderboardLine", "LeaderboardSibling", "Side", "Ordering", "System",
           "register", "unregister", "get", "all_systems", "for_task", "for_model", "tasks", "leaderboard_lines",
           "leaderboard_siblings", "leaderboard_orderings", "stage_file", "LEADERBOARD_RETRIEVAL_FLAGS",
           "LEADERBOARD_REGION_FLAGS"]


@dataclasses.dataclass(frozen=True)
class RunTask:
    """A kind of run folder an experiment writes (``results.json["task"]``)."""
    name: str               # the "task" value the experiment records
    description: str        # for messages: "a ... run"
    experiment: str         # the module that writes such run folders
    draw_tool: str | None   # the module that draws its pictures, if any
    # The names older run folders recorded for this task (before each system had one name): a
    # folder that records one of them is read as this task.
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


# Every leaderboard retrieval run is scored on the dataset's test split under protocol "full" (one
# gallery of every test image, every caption a query): the protocol each system's experiment can
# evaluate on any test split. Exports are skipped (not part of the comparison). The region runs
# are evaluated on every test image, so that every localizer is grounded on the same phrases.
LEADERBOARD_RETRIEVAL_FLAGS = ("--protocol=full", "--noexport")
LEADERBOARD_REGION_FLAGS = ("--noexport", "--max_test_images=0")


@dataclasses.dataclass(frozen=True)
class LeaderboardRun:
    """One run the leaderboard trains: a flagfile (a name in experiments/configs/ or a path) of the
    experiment of `task` (`RunTask.experiment`: its ``define_flags`` and ``run``), and the flags
    added to it. On the embedded data a run keeps its experiment's embedded profile.
    `reference_seconds`: its wall time on the embedded data on the reference machine of
    `tf_twobranch.leaderboard.estimate_seconds` (None: that function's default)."""
    task: str
    flagfile: str
    flags: tuple[str, ...] = ()
    reference_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class LeaderboardLine:
    """A line of the leaderboard: its retrieval run and, for lines that localize phrases, the run
    whose record gives the grounding (None: the retrieval run's record gives it, or, with
    `no_grounding` saying why, the line cannot localize). Lines are shown by `position`."""
    key: str
    name: str
    family: str
    retrieval: LeaderboardRun
    grounding: LeaderboardRun | None = None
    no_grounding: str = ""
    position: int = 100

    @property
    def localizes(self) -> bool:
        return self.grounding is not None or not self.no_grounding

    def grounding_source(self, entry: dict) -> dict | None:
        """The run (of one seed's `entry`) whose record holds this line's grounding."""
        if not self.localizes:
            return None
        return entry.get("grounding") if self.grounding is not None else entry.get("retrieval")


@dataclasses.dataclass(frozen=True)
class LeaderboardSibling:
    """A row the leaderboard runs beside the lines only because a paper ordering compares against it
    (e.g. b5 for "neighbourhood constraints help"); `key` is what an ordering's `Side` names."""
    key: str
    run: LeaderboardRun


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of an ordering: a leaderboard line's or a sibling's record (`source`, its key), and
    its metric: 'rsum' (retrieval), 'pointing' / 'box_r1' (grounding), or 'stage1_rsum' (the first
    stage of a staged record, e.g. the dual path's Stage I)."""
    label: str
    source: str
    metric: str = "rsum"


@dataclasses.dataclass(frozen=True)
class Ordering:
    """A claim of a paper (`paper`) that `better` scores above `worse`, checked seed by seed."""
    claim: str
    paper: str
    better: Side
    worse: Side


@dataclasses.dataclass(frozen=True)
class System:
    """One paper system: its name, its kinds of run, and what the apps call on its runs.

    `load(run_dir, checkpoint) -> run_loading.Run`: the model of a finished run folder.
    `export(run, task) -> export.run_gallery.RunExport`: what `export_run` writes for it.
    `gallery(model, split, image_ids, caption_ids) -> RetrievalGallery`: the retrieval gallery
    its model embeds, as its ``evaluate`` embeds `split`.
    `recognise`: the task of an older folder (no recorded task) from the files only this system's runs write.
    `leaderboard`: its lines in the leaderboard (`experiments.leaderboard`); `orderings`: its paper's
    claims the leaderboard checks over seeds, and `siblings` the extra rows they compare against.
    `smoke_row`: one of its rows at a size the contract test (`tests/systems/test_system_contract.py`) runs
    in seconds on a small dataset folder (given with --dataset_dir and --run_dir).
    """
    name: str
    paper: str
    model_family: str                         # the `ModelConfig.FAMILY` of its models
    tasks: tuple[RunTask, ...]
    load: Callable[[pathlib.Path, str], Any]
    export: Callable[[Any, str], Any]
    gallery: Callable[..., Any]
    # (run_dir, results.json, run_config.json) -> (its task, the file that says so), for folders
    # written before the task was recorded.
    recognise: Callable[[pathlib.Path, dict, dict], tuple[str, str] | None] = lambda run_dir, results, config: None
    leaderboard: tuple[LeaderboardLine, ...] = ()
    orderings: tuple[Ordering, ...] = ()
    siblings: tuple[LeaderboardSibling, ...] = ()
    smoke_row: LeaderboardRun | None = None


_SYSTEMS: dict[str, System] = {}


def stage_file(run_dir: pathlib.Path, file_name: str) -> str | None:
    """`file_name` in the run's last stage folder (``stage2``, ``stage1``) or the run folder itself,
    the first found; for a system's `recognise`."""
    return next((str(run_dir / stage / file_name) for stage in ("stage2", "stage1", ".")
                 if (run_dir / stage / file_name).is_file()), None)


def register(system: System) -> System:
    """Adds `system` (its name and its tasks must be new); returns it."""
    if system.name in _SYSTEMS:
        raise ConfigError(f"a system named {system.name!r} is registered already")
    known = tasks()
    for task in system.tasks:
        for name in task.names:
            if name in known:
                raise ConfigError(f"system {system.name!r}: task {name!r} belongs to another system")
    lines = {line.key for line in leaderboard_lines()} | set(leaderboard_siblings())
    own = {name for t in system.tasks for name in t.names}
    keyed_runs = [(line.key, (line.retrieval, line.grounding)) for line in system.leaderboard]
    keyed_runs += [(sibling.key, (sibling.run,)) for sibling in system.siblings]
    for key, runs in keyed_runs:
        if key in lines:
            raise ConfigError(f"system {system.name!r}: leaderboard key {key!r} belongs to another system")
        for run in runs:
            if run is not None and run.task not in own:
                raise ConfigError(f"system {system.name!r}: leaderboard key {key!r} runs task "
                                  f"{run.task!r}, not one of its own {sorted(own)}")
    _SYSTEMS[system.name] = system
    return system


def unregister(name: str) -> None:
    """Removes a system added with `register` (tests)."""
    _SYSTEMS.pop(name, None)


def get(name: str) -> System:
    """The system called `name`."""
    try:
        return _SYSTEMS[name]
    except KeyError:
        raise ConfigError(f"unknown system {name!r}; known: {', '.join(_SYSTEMS)}") from None


def all_systems() -> tuple[System, ...]:
    """Every registered system, the package's four first."""
    return tuple(_SYSTEMS.values())


def tasks() -> dict[str, RunTask]:
    """Every registered kind of run folder, by its recorded name (and by each older name of it)."""
    return {name: t for s in _SYSTEMS.values() for t in s.tasks for name in t.names}


def for_task(task: str) -> System:
    """The system whose experiments record `task`."""
    for system in _SYSTEMS.values():
        if any(task in t.names for t in system.tasks):
            return system
    raise ConfigError(f"no registered system writes runs of task {task!r}")


def for_model(model) -> System:
    """The system of a built model (its configuration's ``FAMILY``)."""
    family = getattr(getattr(model, "config", None), "FAMILY", None)
    for system in _SYSTEMS.values():
        if system.model_family == family:
            return system
    raise ConfigError(f"{type(model).__name__}: not a model of a registered system (family {family!r})")


def leaderboard_lines() -> tuple[LeaderboardLine, ...]:
    """Every registered system's leaderboard lines, by `position` (then registration order)."""
    lines = [line for system in _SYSTEMS.values() for line in system.leaderboard]
    return tuple(sorted(lines, key=lambda line: line.position))


def leaderboard_siblings() -> dict[str, LeaderboardRun]:
    """Every registered system's ordering siblings, by key (registration order)."""
    return {sibling.key: sibling.run for system in _SYSTEMS.values() for sibling in system.siblings}


def leaderboard_orderings() -> tuple[Ordering, ...]:
    """Every registered system's paper orderings (registration order)."""
    return tuple(ordering for system in _SYSTEMS.values() for ordering in system.orderings)
