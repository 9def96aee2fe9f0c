"""Every row flagfile run at two commits with the same short training; are the metrics the same?

Issue 24's last acceptance line: after the family contract, every flagfile gives the metrics it
gave before, with the same seed. A full embedded-profile run of the 84 rows takes about a day on
two cores (each of the 28 dual-path rows ~25 min), so each row runs here with the same short
training at both commits (the code path of every row is the one its flagfile selects; only epochs,
steps and image counts are smaller), on one copy of the embedded dataset, and their results.json metrics are compared key by key.

    python -m benchmarks.same_metrics --before=ef48abe --work=/tmp/same_metrics [--only=dual_path_*] [--parallel]

The two commits are checked out as git worktrees of this repository under --work; each row runs
in a fresh process whose working directory is its commit's checkout (so that checkout's package is
the one imported).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

# Flagfile prefix -> (experiment, the short-training flags both commits take).
FAMILIES = {
    "two_branch_table1_": ("two_branch_region_phrase",
                           ["--epochs=1", "--constraint_epochs=1", "--hard_negative_epochs=1",
                            "--max_train_images=40", "--max_test_images=20", "--max_proposals=20"]),
    "two_branch_table2_": ("two_branch_retrieval", ["--epochs=1"]),
    "two_branch_table3_": ("two_branch_retrieval", ["--epochs=1"]),
    "two_branch_table5_": ("two_branch_combined_distance", ["--train_overrides=--epochs=1"]),
    # Eager steps: two steps per stage cost less than tracing the step (~18 s a row instead of ~90);
    # 64 images: the reference-code row needs more classes than its batch of 32.
    "dual_path_": ("dual_path", ["--stage1_epochs=1", "--stage2_epochs=1", "--max_train_images=64",
                                 "--max_test_images=50", "--run_eagerly"]),
    "fragments_": ("fragments", ["--epochs=1", "--steps_per_epoch=2",
                                 "--max_train_images=200", "--max_test_images=100"]),
    "npair_": ("npair", ["--epochs=1", "--steps_per_epoch=2",
                         "--max_train_images=200", "--max_test_images=100"]),
}
# Experiments that train other rows (with --train_overrides) and take no --seed/--export of their own.
TRAINS_OTHERS = {"two_branch_combined_distance", "combined_retrieval"}
# Before each system had one name (issue 40, after 5295266) the flagfiles and experiments went by
# their papers': a commit without the renamed flagfile runs the row under its old names.
OLD_PREFIXES = {"two_branch_table": "table", "dual_path_": "zheng_", "fragments_": "karpathy_", "npair_": "das_"}
OLD_EXPERIMENTS = {"two_branch_region_phrase": "phrase_localization",
                   "two_branch_retrieval": "image_sentence_retrieval",
                   "two_branch_combined_distance": "combined_retrieval", "dual_path": "instance_loss",
                   "fragments": "fragment_embeddings", "npair": "npair_localization"}


def experiment_of(stem: str):
    for prefix, spec in FAMILIES.items():
        if stem.startswith(prefix):
            return spec
    raise SystemExit(f"{stem}: no experiment known for this flagfile prefix")


def names_in(tree: pathlib.Path, stem: str) -> tuple[str, str, list[str]]:
    """(flagfile stem, experiment, short flags) of row `stem` as the checkout `tree` names them."""
    experiment, short = experiment_of(stem)
    if (tree / "experiments" / "configs" / f"{stem}.cfg").exists():
        return stem, experiment, short
    prefix = next(p for p in OLD_PREFIXES if stem.startswith(p))
    return OLD_PREFIXES[prefix] + stem[len(prefix):], OLD_EXPERIMENTS[experiment], short


def checkout(work: pathlib.Path, name: str, commit: str) -> pathlib.Path:
    path = work / name
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit],
                       check=True, capture_output=True)
    return path


def run_row(tree: pathlib.Path, stem: str, runs: pathlib.Path, data: pathlib.Path, seed: int) -> dict:
    stem, experiment, short = names_in(tree, stem)
    run_dir = runs / stem
    results = run_dir / "results.json"
    if results.exists():
        return {"seconds": None, "results": json.loads(results.read_text())}
    argv = [sys.executable, "-m", f"experiments.{experiment}",
            f"--flagfile=experiments/configs/{stem}.cfg", f"--run_dir={run_dir}"]
    if experiment in TRAINS_OTHERS:
        # It trains its two source rows itself: the seed and the short training go to both.
        argv += [f"{flag},--seed={seed}" if flag.startswith("--train_overrides=") else flag for flag in short]
    else:
        argv += [f"--seed={seed}", *short, "--noexport", "--verbose=0"]
    env = dict(os.environ, TF_TWOBRANCH_DATA=str(data), PYTHONPATH=str(tree),
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(runs / f"{stem}.log", "w") as log:
        code = subprocess.run(argv, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code != 0 or not results.exists():
        return {"seconds": seconds, "error": f"exit {code}; see {runs / (stem + '.log')}"}
    return {"seconds": seconds, "results": json.loads(results.read_text())}


# Records of how a run was made or how long it took, not what it measured.
NOT_MEASURED = {"flags", "typed_flags", "recipe", "run_dir", "dataset_dir", "dataset", "evaluation",
                "paper", "paper_dataset", "paper_protocol", "paper_results", "row", "task", "export",
                "cost", "files", "next_command", "features_cache", "caches", "command", "argv"}


def _not_measured(key: str) -> bool:
    k = key.lower()
    return (k in NOT_MEASURED or "second" in k or "time" in k or k.endswith(("_dir", "_path", "_file"))
            or "version" in k)


def flat_metrics(results: dict) -> dict:
    """Every number (and split fingerprint) a run measured, keyed by its path in results.json."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                if not _not_measured(str(k)):
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(value, bool) or value is None:
            return
        elif isinstance(value, (int, float)):
            out[prefix] = float(value)
        elif isinstance(value, str) and "fingerprint" in prefix:
            out[prefix] = value

    walk("", results)
    return out


def compare(before: dict, after: dict) -> tuple[int, int, list[str]]:
    b, a = flat_metrics(before), flat_metrics(after)
    common = sorted(set(b) & set(a))
    differ = [k for k in common
              if not (b[k] == a[k] or (isinstance(b[k], float) and isinstance(a[k], float)
                          and math.isnan(b[k]) and math.isnan(a[k])))]
    gone = sorted(set(b) - set(a))   # measured before, missing after: a lost figure counts as a difference
    return (len(common) + len(gone), len(differ) + len(gone),
            [f"{k}: {b[k]!r} -> {a[k]!r}" for k in differ[:5]] + [f"{k}: {b[k]!r} -> (missing)" for k in gone[:5]])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="commit before the change")
    parser.add_argument("--after", default="HEAD", help="commit after the change")
    parser.add_argument("--work", required=True, help="folder for the checkouts, data and runs")
    parser.add_argument("--only", default="*", help="glob over flagfile stems (comma-separated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_json", default="")
    parser.add_argument("--parallel", action="store_true",
                        help="run a row at both commits at once (the shared data's caches must exist: "
                             "run one row of each family first)")
    args = parser.parse_args(argv)

    work = pathlib.Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    trees = {"before": checkout(work, "before", args.before), "after": checkout(work, "after", args.after)}
    data = work / "data" / "digit_scenes"
    patterns = args.only.split(",")
    stems = sorted(p.stem for p in (REPO / "experiments" / "configs").glob("*.cfg")
                   if any(fnmatch.fnmatch(p.stem, pat) for pat in patterns))
    report = []
    for stem in stems:
        row = {"flagfile": stem}
        if args.parallel:
            # The two commits' runs of a row at once: each is mostly single-threaded Python at this size.
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(2) as pool:
                futures = {side: pool.submit(run_row, trees[side], stem, work / "runs" / side, data, args.seed)
                           for side in ("before", "after")}
                row.update({side: future.result() for side, future in futures.items()})
        else:
            for side in ("before", "after"):
                row[side] = run_row(trees[side], stem, work / "runs" / side, data, args.seed)
        if "results" in row["before"] and "results" in row["after"]:
            n, d, examples = compare(row["before"]["results"], row["after"]["results"])
            row["verdict"] = {"numbers": n, "differ": d, "examples": examples}
            verdict = "same" if d == 0 and n else (f"{d} of {n} differ" if n else "no numbers")
        else:
            verdict = "error: " + "; ".join(f"{s}: {row[s]['error']}" for s in ("before", "after")
                                          if "error" in row[s])
        secs = " / ".join(f"{row[s]['seconds']:.0f} s" if row[s].get("seconds") else "reused"
                          for s in ("before", "after"))
        print(f"{stem:55s} {verdict}  ({secs})", flush=True)
        for ex in row.get("verdict", {}).get("examples", []):
            print(f"    {ex}", flush=True)
        for side in ("before", "after"):
            row[side].pop("results", None)
        report.append(row)
    out = pathlib.Path(args.out_json) if args.out_json else work / "same_metrics.json"
    out.write_text(json.dumps({"before": args.before, "after": args.after, "rows": report}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
