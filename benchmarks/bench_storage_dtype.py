"""float16 feature storage against the seed spread: does `--feature_dtype=float16` move rsum more than a new seed?

Run from the repository root:

    python -m benchmarks.bench_storage_dtype [--systems two_branch,fragments,npair] [--seeds 1,2,3]
        [--work_dir /tmp/tf_twobranch_bench_storage] [--out_json benchmarks/results/storage_dtype.json]

For each system, one row of its paper table runs on the embedded default
dataset, as a user runs it (`python -m experiments.<name> --flagfile=...`, a
fresh process per run), once per seed with float32 storage and once per seed
with float16 storage (features stored half, cast back to float32 in the batch
gather). A seed changes everything it seeds (the backbone CNN trained on the
embedded images, word vectors, initialisation, batches); storage changes only
how the features are kept. Printed per system: rsum per seed and storage,
the float16 − float32 difference per seed, and the seed spread (sample
standard deviation and range of the float32 rsums). Target (issue 22): the
mean |float16 − float32| is below the seed spread (standard deviation).

The features cache is shared by a seed's two runs (per system), so each seed's
backbone is trained once. Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

from tf_twobranch.json_files import write_json

ROWS = {
    "two_branch": ("experiments.two_branch_retrieval", "two_branch_table2_b5_nonlinear_bidir_nbr_sampling"),
    "fragments": ("experiments.fragments", "fragments_table2_fragment_global"),
    "npair": ("experiments.npair", "npair_table1_flickr30k"),
}
REPO = pathlib.Path(__file__).resolve().parents[1]


def _rsum(record: dict) -> float:
    metrics = record.get("metrics") or record.get("retrieval", {})
    if "rsum" in metrics:
        return float(metrics["rsum"])
    # N-pair: one result per protocol; the row's own protocol first.
    protocol = record.get("protocol")
    chosen = metrics.get(protocol) or next(iter(metrics.values()))
    return float(chosen["rsum"])


def run_row(system: str, seed: int, dtype: str, work: pathlib.Path) -> dict:
    module, row = ROWS[system]
    run_dir = work / system / f"seed{seed}_{dtype}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", module, f"--flagfile={REPO / 'experiments' / 'configs' / (row + '.cfg')}",
               f"--seed={seed}", f"--feature_dtype={dtype}", f"--run_dir={run_dir}",
               f"--features_cache={work / system / f'cache_seed{seed}'}", "--noexport", "--verbose=0"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads((run_dir / "results.json").read_text())
    return {"seed": seed, "dtype": dtype, "rsum": _rsum(record), "seconds": seconds, "command": " ".join(command)}


def summary(runs: list[dict]) -> dict:
    by = {(r["seed"], r["dtype"]): r["rsum"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    f32 = np.array([by[s, "float32"] for s in seeds])
    diffs = np.array([by[s, "float16"] - by[s, "float32"] for s in seeds])
    spread = float(np.std(f32, ddof=1)) if len(seeds) > 1 else float("nan")
    mean_abs = float(np.mean(np.abs(diffs)))
    return {"seeds": seeds, "rsum_float32": f32.tolist(), "float16_minus_float32": diffs.tolist(),
            "mean_abs_difference": mean_abs, "seed_std": spread, "seed_range": float(np.ptp(f32)),
            "pass": bool(mean_abs < spread)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default=",".join(ROWS))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--work_dir", default="/tmp/tf_twobranch_bench_storage")
    parser.add_argument("--out_json", default="")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(ROWS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {sorted(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    work = pathlib.Path(args.work_dir)
    results = {}
    for system in systems:
        runs = []
        for seed in seeds:
            for dtype in ("float32", "float16"):
                runs.append(run_row(system, seed, dtype, work))
                print(f"  {system:10s} seed {seed} {dtype:7s}: rsum {runs[-1]['rsum']:6.1f} "
                      f"({runs[-1]['seconds']:.0f} s)", flush=True)
        s = summary(runs)
        results[system] = {"row": ROWS[system][1], "runs": runs, **s}
        print(f"  {system:10s} ({ROWS[system][1]}): float16 - float32 per seed "
              f"{', '.join(f'{d:+.1f}' for d in s['float16_minus_float32'])} (mean |d| {s['mean_abs_difference']:.2f}); "
              f"seed spread: std {s['seed_std']:.2f}, range {s['seed_range']:.1f}  "
              f"[{'PASS' if s['pass'] else 'FAIL'}: mean |d| < seed std]", flush=True)
    if args.out_json:
        write_json(args.out_json, results)
    return results


if __name__ == "__main__":
    main()
