r"""The leaderboard: every registered system's lines on one dataset, one test split, one protocol.

    python -m experiments.leaderboard                      # embedded data, seeds 0, 1, 2
    python -m experiments.leaderboard --dataset_dir=/data/flickr30k --seeds=1 \
        --row_flag='*:--word_vectors=/weights/glove.txt'

Trains (or reuses, with --skip_existing) each line's runs (`System.leaderboard`) through its
experiment's own entry (`define_flags`, `run`), each in a fresh process; prints one table (mean ±
std over seeds, retrieval under protocol "full", grounding on the same Entities phrases) and writes
leaderboard.{json,csv,png,txt}. The table logic lives in tf_twobranch/leaderboard.py.
"""
from __future__ import annotations

import importlib
import pathlib
import time

from absl import app, flags, logging

from experiments import common
from tf_twobranch import leaderboard as lb, memory
from tf_twobranch.systems.registry import LeaderboardLine, LeaderboardRun
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.errors import UserInputError

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("dataset_dir", "", "Dataset folder every system reads; empty: the embedded data.", **d)
    flags.DEFINE_integer("seeds", 3, "Seeds per system (0 .. N-1); every cell is mean ± std over them.",
                         lower_bound=1, **d)
    keys = lb.line_keys()
    flags.DEFINE_list("systems", list(keys), f"Leaderboard lines to run, of {', '.join(keys)} (every "
                      "registered system's lines).", **d)
    flags.DEFINE_bool("grounding", True, "Also run the two-branch region–phrase grounding runs.", **d)
    flags.DEFINE_bool("skip_existing", True, "Reuse a finished run made with the same flags instead of "
                      "training it again (--noskip_existing retrains).", **d)
    flags.DEFINE_bool("reuse_only", False, "Train nothing: the table of the finished runs, every other run "
                      "listed as not run yet (e.g. while a long invocation is still going).", **d)
    flags.DEFINE_multi_string("row_flag", [], "TARGET:--flag=value added to runs: TARGET is a system key, "
                              "an experiment name (e.g. dual_path) or '*' (every run whose experiment "
                              "has the flag). Repeatable.", **d)
    flags.DEFINE_bool("orderings", True, "Also run the sibling rows the paper orderings need (b5, \u2020 "
                      "without MIL, triplet, centre baseline) and print, for each ordering, the paired "
                      "differences over seeds and whether it holds beyond the seed spread.", **d)
    flags.DEFINE_string("runs_dir", "", "Parent of the run folders (default runs/leaderboard).", **d)
    flags.DEFINE_string("out_dir", "", "Where the leaderboard files go (default <runs_dir>/<dataset>).", **d)


def arguments_of(key: str, run: LeaderboardRun, seed: int, run_dir: pathlib.Path, f) -> list[str]:
    """The flags a run of line (or sibling) `key` is trained with, and reused by."""
    defined = flags.FlagValues()
    module = lb.experiment_of(run)
    importlib.import_module(module).define_flags(defined)
    extra = ["--verbose=0", *lb.row_flags(f.row_flag, key, module.rsplit(".", 1)[-1], defined)]
    return lb.run_arguments(run, dataset_dir=f.dataset_dir, seed=seed, run_dir=run_dir, extra=extra)


def run_one(system: LeaderboardLine, run: LeaderboardRun, seed: int, run_dir: pathlib.Path, f) -> dict:
    """One run of a system: reused when finished with the same flags, else trained; a dataset
    the run cannot use gives {"error": reason}."""
    arguments = arguments_of(system.key, run, seed, run_dir, f)
    if f.skip_existing:
        finished = lb.finished_run(run_dir, arguments, needs_grounding=system.localizes and (
            run is system.grounding or system.grounding is None))
        if finished:
            print(f"  {run.flagfile} (seed {seed}): reused {run_dir}", flush=True)
            return finished
    if f.reuse_only:
        return {"error": f"not run yet (--reuse_only): {run.flagfile}, seed {seed}"}
    print(f"  {run.flagfile} (seed {seed}): training -> {run_dir}", flush=True)
    try:
        record, cost, peak_gb = memory.call_in_fresh_process(
            train_row, lb.experiment_of(run), str(common.resolve_config(run.flagfile)), arguments)
    except UserInputError as err:
        logging.warning("%s: %s", run.flagfile, err)
        print(f"    not available: {err}", flush=True)
        return {"error": str(err)}
    lb.mark_finished(run_dir, arguments, cost)
    print(f"    done; its process peaked at {peak_gb:.1f} GB", flush=True)
    return {"record": record, "cost": cost.as_dict(), "reused": False}


def train_row(experiment: str, flagfile: str, arguments) -> tuple[dict, "lb.RowCost", float]:
    """One run, in the fresh process `run_one` starts for it (so the leaderboard's memory is one
    run's, not the sum of all): (its record, its cost, the process's peak RSS in GB)."""
    module = importlib.import_module(experiment)
    fv = common.parse_flagfile(module.define_flags, flagfile, arguments)
    with lb.measure_row() as cost:
        record = module.run(fv)
    return record, cost, memory.status_kib("self", ("VmHWM",)).get("VmHWM", 0) * 1024 / 1e9


def print_estimate(f, base: pathlib.Path) -> None:
    """Up front, like the main job: the runs to train, the reused ones, the expected time."""
    planned = lb.planned_runs(f.systems, f.seeds, base, grounding=f.grounding, orderings=f.orderings)
    to_train = []
    for key, run, seed, folder in planned:
        marker = lb.finished_run(folder, arguments_of(key, run, seed, folder, f)) if f.skip_existing else None
        if marker is None and not f.reuse_only:
            to_train.append((key, run))
    print(lb.estimate_message(len(planned), [run for _, run in to_train], f.dataset_dir), flush=True)


def run_leaderboard(f) -> dict:
    """Runs (or reuses) every selected system for every seed; returns the leaderboard and its files."""
    unknown = sorted(set(f.systems) - set(lb.line_keys()))
    if unknown:
        raise UserInputError(f"--systems: unknown {unknown}; choose from {', '.join(lb.line_keys())}")
    if f.dataset_dir and not pathlib.Path(f.dataset_dir).is_dir():
        raise UserInputError(f"--dataset_dir={f.dataset_dir}: dataset folder does not exist")
    start = time.time()
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else common.REPO_ROOT / "runs" / "leaderboard"
    base = runs_dir / lb.dataset_tag(f.dataset_dir)
    seeds = list(range(f.seeds))
    print_estimate(f, base)
    lines = {line.key: line for line in lb.lines()}
    runs: dict[str, dict[int, dict]] = {}
    for key, run, seed, folder in lb.planned_runs(f.systems, f.seeds, base, grounding=f.grounding,
                                                  orderings=f.orderings):
        line = lines[key] if key in lines else LeaderboardLine(key, key, "sibling", run, no_grounding="sibling")
        if key not in runs:
            print(f"=== {line.name}" if key in lines else f"=== ordering sibling {key} ({run.flagfile})", flush=True)
        entry = runs.setdefault(key, {}).setdefault(seed, {})
        kind = "grounding" if key in lines and run is line.grounding else "retrieval"
        entry[kind] = run_one(line, run, seed, folder, f)
        if key in lines and line.grounding and not f.grounding:
            entry["grounding"] = {"error": f"not run (--nogrounding): {line.grounding.flagfile}"}
    system_runs = {k: [runs[k][s] for s in seeds] for k in runs if k in lines}
    sibling_runs = {k: [runs[k][s] for s in seeds] for k in runs if k not in lines}
    return lb.finish(system_runs, sibling_runs, dataset_dir=f.dataset_dir, seeds=seeds, base=base,
                     out_dir=pathlib.Path(f.out_dir) if f.out_dir else base, start=start,
                     orderings=f.orderings, meta={"systems": [s.key for s in lb.lines() if s.key in f.systems],
                                                  "typed_flags": common.typed_flags(f)})


def _main() -> None:
    result = run_leaderboard(FLAGS)
    print("\n" + result["table"] + "".join(f"\n{kind}: {path}" for kind, path in result["files"].items()))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
