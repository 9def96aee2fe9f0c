"""What kind of run a run folder holds, read from the folder alone (no TensorFlow import).

Every experiment records its task: ``results.json["task"]`` (newer runs) and
``run_config.json["task"]`` (in the run folder or its ``stage1``/``stage2``);
older folders are recognised by the files their experiment writes
(``fragment_config.json``, ``npair_config.json``, ``dual_path_config.json``).
The draw tools call `require_run_task` so that a run folder of another family
is refused with its kind and the tool that takes it, instead of failing later
on a file that kind of run never writes.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

from tf_twobranch.errors import UserInputError

__all__ = ["RunTask", "TASKS", "read_run_task", "require_run_task"]


@dataclasses.dataclass(frozen=True)
class RunTask:
    name: str               # the "task" value the experiment records
    description: str        # for messages: "a ... run"
    experiment: str         # the module that writes such run folders
    draw_tool: str | None   # the module that draws its pictures, if any


TASKS = {t.name: t for t in (
    RunTask("image_sentence_retrieval", "an image-sentence retrieval run (two-branch networks)",
            "experiments.image_sentence_retrieval", None),
    RunTask("phrase_localization", "a phrase-localization run (two-branch networks, Algorithm 1)",
            "experiments.phrase_localization", "experiments.draw_localization"),
    RunTask("dual_path", "an instance-loss run (dual-path CNN, Zheng et al.)",
            "experiments.instance_loss", None),
    RunTask("fragment_embeddings", "a deep-fragment-embedding run (Karpathy et al.)",
            "experiments.fragment_embeddings", "experiments.draw_fragments"),
    RunTask("npair_localization", "an N-pair localization run (Das et al.)",
            "experiments.npair_localization", "experiments.draw_heat_maps"),
)}

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
    for path in recorded:
        task = _json_object(path).get("task") if path.is_file() else None
        if task in TASKS:
            return TASKS[task], str(path)
    # Folders written before every experiment recorded its task: the files only one kind writes.
    for stage in _STAGES:
        for marker, task in (("fragment_config.json", "fragment_embeddings"),
                             ("npair_config.json", "npair_localization"),
                             ("dual_path_config.json", "dual_path")):
            if (run_dir / stage / marker).is_file():
                return TASKS[task], str(run_dir / stage / marker)
    results = run_dir / "results.json"
    if results.is_file() and "row_kind" in _json_object(results):   # an N-pair baseline row
        return TASKS["npair_localization"], str(results)
    config = run_dir / "run_config.json"
    if config.is_file() and isinstance(_json_object(config).get("model"), dict):
        return TASKS["image_sentence_retrieval"], str(config)
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
    if kind.draw_tool:
        where = f"draw it with python -m {kind.draw_tool} --run_dir={run_dir}"
    else:
        where = "no draw tool takes that kind of run (tf_twobranch.runs.load_run loads it)"
    raise UserInputError(
        f"--run_dir={run_dir}: {kind.description} (task {kind.name!r}, from {source}), but {tool} draws "
        f"{TASKS[task].description.split(' (')[0].removeprefix('a ').removeprefix('an ')}s of python -m "
        f"{TASKS[task].experiment}; {where}")
