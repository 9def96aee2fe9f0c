"""What kind of run a run folder holds, read from the folder alone (no TensorFlow import).

Every experiment records its task: ``results.json["task"]`` (newer runs) and
``run_config.json["task"]`` (in the run folder or its ``stage1``/``stage2``);
an older folder is recognised by its system (`System.recognise`: the files only
that system's runs write). The tasks are the registered systems'
(`tf_twobranch.systems`). The draw tools call `require_run_task` so that a run
folder of another kind is refused with its kind and the tool that takes it,
instead of failing later on a file that kind of run never writes.
"""
from __future__ import annotations

import json
import pathlib

from tf_twobranch import systems
from tf_twobranch.errors import UserInputError
from tf_twobranch.systems import RunTask

__all__ = ["RunTask", "read_run_task", "require_run_task"]


_STAGES = ("stage2", "stage1", ".")


def _json_object(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}   # an unreadable record says nothing about the kind; its reader reports it
    return data if isinstance(data, dict) else {}


def read_run_task(run_dir) -> tuple[RunTask, str] | None:
    """The task of the run in `run_dir` and the file that says so, or None when nothing does."""
    run_dir = pathlib.Path(run_dir)
    recorded = [run_dir / "results.json"] + [run_dir / s / "run_config.json" for s in _STAGES]
    known = systems.tasks()
    for path in recorded:
        task = _json_object(path).get("task") if path.is_file() else None
        if task in known:
            return known[task], str(path)
    # Folders written before every experiment recorded its task: the files only one system writes.
    results_path, config_path = run_dir / "results.json", run_dir / "run_config.json"
    results = _json_object(results_path) if results_path.is_file() else {}
    run_config = _json_object(config_path) if config_path.is_file() else {}
    # A rule on a file only one system writes comes before one on run_config.json's contents.
    for view in ({}, run_config):
        for system in systems.all():
            found = system.recognise(run_dir, results, view)
            if found is not None:
                return known[found[0]], found[1]
    return None


def require_run_task(run_dir, task: str, tool: str) -> None:
    """Refuses `run_dir` when it holds a run of another task than `task`, which `tool` draws.

    A folder whose kind cannot be read passes: the tool's own checks then
    say which file is missing.
    """
    found = read_run_task(run_dir)
    if found is None or found[0].name == task:
        return
    kind, source = found
    wanted = systems.tasks()[task]
    if kind.draw_tool:
        where = f"draw it with python -m {kind.draw_tool} --run_dir={run_dir}"
    else:
        where = "no draw tool takes that kind of run (tf_twobranch.runs.load_run loads it)"
    raise UserInputError(
        f"--run_dir={run_dir}: {kind.description} (task {kind.name!r}, from {source}), but {tool} draws "
        f"{wanted.description.split(' (')[0].removeprefix('a ').removeprefix('an ')}s of python -m "
        f"{wanted.experiment}; {where}")
