r"""The leaderboard: every system of the four families on one dataset, one test split, one protocol.

    python -m experiments.leaderboard                      # embedded data, seeds 0, 1, 2
    python -m experiments.leaderboard --seeds=1            # one seed
    python -m experiments.leaderboard --dataset_dir=/data/flickr30k --seeds=1 \
        --row_flag='*:--word_vectors=/weights/glove.txt'

Trains (or, with --skip_existing, the default, reuses finished runs of) random
ranking, CCA, the two-branch embedding network (full model) and similarity
network, the dual-path CNN (Stage II), deep fragment embeddings († + MIL) and
N-pair localization through their experiments' own entry (`define_flags`,
`run`) on their paper flagfiles, every retrieval run under protocol "full" on
the dataset's test split; grounding (the pointing game for every localizer, box
R@1 at IoU 0.5 for the box rankers, on the same Entities phrases) comes from the
N-pair and fragment runs and the two-branch region–phrase runs of
experiments.phrase_localization (on every test image). Prints one table
(mean ± std over seeds) and writes leaderboard.{json,csv,png,txt} in --out_dir.
Rows measured on another split or protocol, and grounding on other phrases, are
listed apart, never in the table; rows a folder cannot serve are listed with
the reason. The table logic lives in tf_twobranch/leaderboard.py.
"""
from __future__ import annotations

import hashlib
import importlib
import pathlib
import time

from absl import app, flags, logging

from experiments import common
from tf_twobranch import leaderboard as lb, memory, systems
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
                              "an experiment name (e.g. instance_loss) or '*' (every run whose experiment "
                              "has the flag). Repeatable.", **d)
    flags.DEFINE_bool("orderings", True, "Also run the sibling rows the paper orderings need (b5, \u2020 "
                      "without MIL, triplet, centre baseline) and print, for each ordering, the paired "
                      "differences over seeds and whether it holds beyond the seed spread.", **d)
    flags.DEFINE_string("runs_dir", "", "Parent of the run folders (default runs/leaderboard).", **d)
    flags.DEFINE_string("out_dir", "", "Where the leaderboard files go (default <runs_dir>/<dataset>).", **d)


def dataset_tag(dataset_dir: str) -> str:
    """The run-folder name of a dataset: 'embedded', or the folder's name and a hash of its path."""
    if not dataset_dir:
        return "embedded"
    path = str(pathlib.Path(dataset_dir).resolve())
    return f"{common.slug(pathlib.Path(path).name)}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def experiment_of(run: LeaderboardRun) -> str:
    """The module (``define_flags``, ``run``) of the experiment that trains `run`: its task's."""
    return systems.tasks()[run.task].experiment


def _row_flags(values, system_key: str, experiment: str, defined) -> list[str]:
    out = []
    for value in values:
        target, sep, flag = value.partition(":")
        if not sep or not flag.startswith("--"):
            raise UserInputError(f"--row_flag={value!r}: expected TARGET:--flag=value")
        experiments = {experiment_of(r).rsplit(".", 1)[-1] for s in lb.lines() for r in (s.retrieval, s.grounding) if r}
        if target not in ("*", experiment, *lb.line_keys(), *experiments):
            raise UserInputError(f"--row_flag={value!r}: unknown target {target!r} (a system key, an "
                                 "experiment name or '*')")
        name = flag[2:].split("=", 1)[0]
        if target in (system_key, experiment) or (target == "*" and (name in defined or
                                                                    name.removeprefix("no") in defined)):
            out.append(flag)
    return out


def arguments_of(key: str, run: LeaderboardRun, seed: int, run_dir: pathlib.Path, f) -> list[str]:
    """The flags a run of line (or sibling) `key` is trained with, and reused by."""
    defined = flags.FlagValues()
    module = experiment_of(run)
    importlib.import_module(module).define_flags(defined)
    extra = ["--verbose=0", *_row_flags(f.row_flag, key, module.rsplit(".", 1)[-1], defined)]
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
            train_row, experiment_of(run), str(common.resolve_config(run.flagfile)), arguments)
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


def _max_proposals(system_runs: dict) -> int | None:
    """How many proposals per image the box rankers' region runs ranked (their recorded flags)."""
    for runs in system_runs.values():
        for entry in runs:
            record = (entry.get("grounding") or {}).get("record") or {}
            if (record.get("flags") or {}).get("max_proposals"):
                return int(record["flags"]["max_proposals"])
    return None


def grounding_baselines(f, board: dict, system_runs: dict) -> dict:
    """The random-point, centre and random-proposal baselines on the dataset's test phrases, when
    they are the table's (`lb.grounding_baselines` checks the phrase fingerprint)."""
    if not board["phrases"].get("phrase_fingerprint"):
        return {"not_computed": "no grounding cell in the table"}
    from tf_twobranch.data.formats.proposals import read_proposals
    from tf_twobranch.data.from_flags import dataset_folder
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.evaluation.pointing_game import pointing_queries

    try:
        layout = resolve_dataset(dataset_folder(f.dataset_dir or None))
        layout.require("entities", purpose="the grounding baselines")
        ids = layout.split_ids("test")
        queries = pointing_queries(layout.entities_dir, ids)
        proposals = read_proposals(layout.proposals, ids) if layout.has("proposals") else None
    except UserInputError as err:
        return {"not_computed": str(err)}
    return lb.grounding_baselines(queries, board["phrases"], proposals, _max_proposals(system_runs))


def planned_runs(f, base: pathlib.Path) -> list[tuple]:
    """(system key or sibling key, run, seed, run folder) of every run this invocation needs."""
    seeds = range(f.seeds)
    planned = []
    for system in lb.lines():
        if system.key in f.systems:
            for seed in seeds:
                folder = base / f"seed{seed}" / system.key
                planned.append((system.key, system.retrieval, seed, folder / "retrieval"))
                if system.grounding and f.grounding:
                    planned.append((system.key, system.grounding, seed, folder / "grounding"))
    for key in (lb.siblings_needed(f.systems) if f.orderings else []):
        planned += [(key, lb.SIBLINGS[key], seed, base / f"seed{seed}" / "siblings" / key) for seed in seeds]
    return planned


def print_estimate(f, base: pathlib.Path) -> None:
    """Up front, like the main job: the runs to train, the reused ones, the expected time."""
    planned = planned_runs(f, base)
    to_train = []
    for key, run, seed, folder in planned:
        marker = lb.finished_run(folder, arguments_of(key, run, seed, folder, f)) if f.skip_existing else None
        if marker is None and not f.reuse_only:
            to_train.append((key, run))
    reused = len(planned) - len(to_train)
    if not to_train:
        print(f"Estimated time: seconds ({len(planned)} runs, every one reused or skipped).", flush=True)
        return
    if f.dataset_dir:
        print(f"Estimated time: depends on your dataset's size ({len(to_train)} runs to train, "
              f"{reused} reused).", flush=True)
        return
    low = lb.estimate_seconds([run for _, run in to_train]) / 60
    print(f"Estimated time on this machine: {low:.0f}–{low * lb.ESTIMATE_SPREAD:.0f} min for "
          f"{len(to_train)} runs to train ({reused} reused; the first run of a seed also computes its "
          "features).", flush=True)


def run_leaderboard(f) -> dict:
    """Runs (or reuses) every selected system for every seed; returns the leaderboard and its files."""
    unknown = sorted(set(f.systems) - set(lb.line_keys()))
    if unknown:
        raise UserInputError(f"--systems: unknown {unknown}; choose from {', '.join(lb.line_keys())}")
    if f.dataset_dir and not pathlib.Path(f.dataset_dir).is_dir():
        raise UserInputError(f"--dataset_dir={f.dataset_dir}: dataset folder does not exist")
    start = time.time()
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else common.REPO_ROOT / "runs" / "leaderboard"
    base = runs_dir / dataset_tag(f.dataset_dir)
    seeds = list(range(f.seeds))
    print_estimate(f, base)
    system_runs: dict[str, list[dict]] = {}
    for system in lb.lines():
        if system.key not in f.systems:
            continue
        print(f"=== {system.name}", flush=True)
        for seed in seeds:
            folder = base / f"seed{seed}" / system.key
            entry = {"retrieval": run_one(system, system.retrieval, seed, folder / "retrieval", f)}
            if system.grounding and f.grounding:
                entry["grounding"] = run_one(system, system.grounding, seed, folder / "grounding", f)
            elif system.grounding:
                entry["grounding"] = {"error": f"not run (--nogrounding): {system.grounding.flagfile}"}
            system_runs.setdefault(system.key, []).append(entry)
    sibling_runs: dict[str, list[dict]] = {}
    for key in (lb.siblings_needed(f.systems) if f.orderings else []):
        run = lb.SIBLINGS[key]
        print(f"=== ordering sibling {key} ({run.flagfile})", flush=True)
        sibling = LeaderboardLine(key, key, "sibling", run, no_grounding="sibling")
        sibling_runs[key] = [{"retrieval": run_one(sibling, run, seed, base / f"seed{seed}" / "siblings" / key, f)}
                             for seed in seeds]
    board = lb.assemble(system_runs)
    board["grounding_baselines"] = grounding_baselines(f, board, system_runs)
    board["orderings"] = lb.check_orderings({**system_runs, **sibling_runs}) if f.orderings else []
    dataset = f.dataset_dir or "the embedded data"
    footer = [f"runs: {base}; wall time of this invocation {time.time() - start:.0f} s "
              f"({lb.run_counts(board)})"]
    table = lb.format_table(board, dataset=dataset, seeds=seeds, footer=footer)
    if board["orderings"]:
        table += "\n\n" + lb.format_orderings(board["orderings"])
    meta = {"dataset": dataset, "seeds": seeds, "seconds": time.time() - start,
            "systems": [s.key for s in lb.lines() if s.key in f.systems],
            "typed_flags": common.typed_flags(f)}
    out_dir = pathlib.Path(f.out_dir) if f.out_dir else base
    files = lb.write_outputs(out_dir, board, table, meta)
    return {"board": board, "table": table, "files": files}


def _main() -> None:
    result = run_leaderboard(FLAGS)
    print()
    print(result["table"])
    for kind, path in result["files"].items():
        print(f"{kind}: {path}")


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
