"""The leaderboard of the four families on one dataset, one test split and one protocol.

`experiments/leaderboard.py` runs the systems below through their
experiments' public entry (`define_flags`, `run`) and hands their results
records here. This module holds what is not an experiment: which rows make
the leaderboard (`SYSTEMS`), what a row costs (`measure_row`: parameters,
time in training and in evaluation), reusing a finished run
(`finished_run`), the comparability check (rows are put in one table only
when their protocol and test-split fingerprint agree), mean ± std over
seeds, the table, and the JSON / CSV / PNG files. It defines no flags and
imports no experiment.

Every metric comes from the records, i.e. from the one evaluation core
(`tf_twobranch/evaluation/`): retrieval R@K and median rank
(`evaluation/retrieval.py`), phrase localization R@1 at IoU >= 0.5
(`evaluation/phrase_localization.py`), the pointing game
(`evaluation/pointing_game.py`).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import pathlib
import time
from typing import Iterator, Sequence

import numpy as np

from tf_twobranch import json_files

RETRIEVAL_KEYS = ("i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "rsum")
GROUNDING_KEYS = ("pointing", "box_r1")
COST_KEYS = ("params", "train_s", "eval_s")
COLUMNS = {"i2t_r1": "I2T R@1", "i2t_r5": "R@5", "i2t_r10": "R@10", "i2t_medr": "medr",
           "t2i_r1": "T2I R@1", "t2i_r5": "R@5", "t2i_r10": "R@10", "t2i_medr": "medr", "rsum": "rsum",
           "pointing": "point %", "box_r1": "box R@1", "params": "params",
           "train_s": "train s", "eval_s": "eval s"}
GROUNDING_RULE = ("grounding on the Flickr30K Entities test phrases of the dataset: 'point %' = pointing "
                  "game (the heat map's maximum inside a ground-truth box of the phrase, "
                  "evaluation/pointing_game.py); 'box R@1' = R@1 at IoU >= 0.5 over the ranked proposals "
                  "(evaluation/phrase_localization.py)")
# The sidecar a finished leaderboard run leaves beside its results.json.
MARKER = "leaderboard_row.json"


@dataclasses.dataclass(frozen=True)
class Run:
    """One experiment row the leaderboard trains: `experiment` (a module of experiments/),
    its flagfile, the flags added to it, and those added on the embedded data only (reduced epochs)."""
    experiment: str
    flagfile: str
    flags: tuple[str, ...] = ()
    embedded_flags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class System:
    """A leaderboard line: its retrieval run and, for systems that localize phrases, the
    run whose record gives the grounding (None: the system cannot; `no_grounding` says why)."""
    key: str
    name: str
    family: str
    retrieval: Run
    grounding: Run | None = None
    no_grounding: str = ""


# Every retrieval run is scored on the dataset's test split under protocol "full" (one gallery
# of every test image, every caption a query): the protocol each family's experiment can
# evaluate on any test split (fragment rows: full|first_caption; N-pair: its Table 1 default
# folds_100 is replaced). Exports are skipped (not part of the comparison).
_COMMON = ("--protocol=full", "--noexport")
SYSTEMS: tuple[System, ...] = (
    System("random", "Random ranking", "fragment embeddings (Karpathy Table 3)",
           Run("fragment_embeddings", "karpathy_table3_random_ranking", _COMMON),
           no_grounding="random scores rank captions only (no boxes, no heat maps)"),
    System("cca", "CCA (FV HGLMM)", "two-branch baseline (TPAMI Tables 1-2)",
           Run("image_sentence_retrieval", "table2_a1_cca_fv_hglmm", _COMMON),
           Run("phrase_localization", "table1_a_cca", ("--noexport",))),
    System("embedding", "Two-branch embedding network (full model)", "two-branch (TPAMI Table 2 b6)",
           Run("image_sentence_retrieval", "table2_b6_nonlinear_bidir_nbr_constraints", _COMMON),
           Run("phrase_localization", "table1_b6_nonlinear_augm_pos_bidir_nbr_constraints", ("--noexport",))),
    System("similarity", "Two-branch similarity network", "two-branch (TPAMI Table 2 d)",
           Run("image_sentence_retrieval", "table2_d_similarity", _COMMON),
           Run("phrase_localization", "table1_c4_similarity_nonlinear_augm_pos", ("--noexport",))),
    System("dual_path", "Dual-path CNN, Stage II", "dual-path CNN (Zheng Table 1, ResNet-50 row)",
           Run("instance_loss", "zheng_table1_resnet50_stage2", _COMMON,
               embedded_flags=("--stage1_epochs=60", "--stage2_epochs=15")),
           no_grounding="global image and text vectors only: no regions, no heat maps"),
    System("fragments", "Deep fragment embeddings († + MIL)", "fragment embeddings (Karpathy Table 3)",
           Run("fragment_embeddings", "karpathy_table3_fragment_global_mil", _COMMON),
           no_grounding="best-aligned image fragment per Entities phrase not computed yet "
                        "(evaluation/fragment_alignment.best_image_fragments gives it per sentence "
                        "fragment; the phrase-to-triplet mapping is open)"),
    System("npair", "N-pair phrase localization (word mode)", "N-pair localization (Das Table 2)",
           Run("npair_localization", "das_table2_npair_word", (*_COMMON, "--row_metric=auto"))),
)
SYSTEM_KEYS = tuple(s.key for s in SYSTEMS)


def reduced_epochs_note() -> str:
    """The footer line stating what the embedded data's leaderboard shortens."""
    parts = [f"{s.key}: {' '.join(s.retrieval.embedded_flags)}" for s in SYSTEMS if s.retrieval.embedded_flags]
    return ("reduced epochs on the embedded data (beyond each experiment's embedded profile): "
            + "; ".join(parts)) if parts else ""


# ---------------------------------------------------------------------------- cost


@dataclasses.dataclass
class RowCost:
    """What one run cost: parameters of the trained model, seconds in training calls, seconds
    from the end of each training call to the next one or the end of the row (evaluation)."""
    params: int | None = None
    train_s: float | None = None
    eval_s: float | None = None
    _last_end: float | None = None

    def close(self, now: float) -> None:
        if self._last_end is not None:
            self.eval_s = (self.eval_s or 0.0) + now - self._last_end
            self._last_end = None

    def as_dict(self) -> dict:
        return {"params": self.params, "train_s": self.train_s, "eval_s": self.eval_s}


def _model_params(model) -> int | None:
    try:
        return int(model.count_params())
    except (AttributeError, ValueError):
        return None


def _cca_params(cca) -> int:
    return int(sum(np.asarray(getattr(cca, name)).size for name in
                   ("image_mean_", "text_mean_", "image_projection_", "text_projection_")))


@contextlib.contextmanager
def measure_row() -> Iterator[RowCost]:
    """Measures a row run inside the block through the package's one trainer (`trainer.train`)
    and the CCA baseline's `fit`, the two ways a system is trained.

    Training seconds are the time inside those calls; evaluation seconds the time from the end
    of each call to the next one or to the end of the block (scoring the test split, the
    grounding, writing the record); data loading and cached features before the first call
    count in neither. Parameters: every weight of the trained model (frozen backbones included).
    """
    from tf_twobranch.baselines.cca import CCABaseline
    from tf_twobranch.training import trainer

    cost = RowCost()
    original_train, original_fit = trainer.train, CCABaseline.fit

    def timed(call, count):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            cost.close(start)
            try:
                return call(*args, **kwargs)
            finally:
                end = time.perf_counter()
                cost.train_s = (cost.train_s or 0.0) + end - start
                cost._last_end = end
                cost.params = max(cost.params or 0, count(args[0]) or 0)
        return wrapper

    trainer.train = timed(original_train, _model_params)
    CCABaseline.fit = timed(original_fit, _cca_params)
    try:
        yield cost
    finally:
        trainer.train, CCABaseline.fit = original_train, original_fit
        cost.close(time.perf_counter())


# ---------------------------------------------------------------------------- runs


def run_arguments(run: Run, *, embedded: bool, dataset_dir: str, seed: int, run_dir: pathlib.Path,
                  extra: Sequence[str] = ()) -> list[str]:
    """The flags added to a run's flagfile: the leaderboard's, the dataset, the seed, the run folder
    and the caller's `extra` (last, so they win)."""
    args = [*run.flags, *(run.embedded_flags if embedded else ()), f"--seed={seed}", f"--run_dir={run_dir}"]
    if dataset_dir:
        args.append(f"--dataset_dir={dataset_dir}")
    return [*args, *extra]


def finished_run(run_dir: pathlib.Path, arguments: Sequence[str]) -> dict | None:
    """The record and cost of a finished leaderboard run made with these arguments, else None."""
    marker, results = run_dir / MARKER, run_dir / "results.json"
    if not (marker.exists() and results.exists()):
        return None
    saved = json_files.read_json_object(marker, "leaderboard run marker")
    record = json_files.read_json_object(results, "run results")
    if saved.get("arguments") != list(arguments) or "test_split_fingerprint" not in record:
        return None
    return {"record": record, "cost": saved["cost"], "reused": True}


def mark_finished(run_dir: pathlib.Path, arguments: Sequence[str], cost: RowCost) -> None:
    """Writes the sidecar that lets `finished_run` reuse this run."""
    json_files.write_json(run_dir / MARKER, {"arguments": list(arguments), "cost": cost.as_dict(),
                                            "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})


# ---------------------------------------------------------------------------- rows


def retrieval_cells(record: dict) -> dict:
    """R@1/5/10, median rank both ways and rsum of a retrieval run's record (its protocol)."""
    metrics = record.get("metrics") or {}
    return {k: float(metrics[k]) for k in RETRIEVAL_KEYS if k in metrics}


def grounding_cells(record: dict) -> dict:
    """The grounding cells a record has: pointing accuracy (N-pair) or box R@1 at IoU 0.5
    (phrase localization), with the number of phrases they are over."""
    metrics = record.get("metrics") or {}
    out = {}
    if "pointing_accuracy" in metrics:
        out["pointing"] = float(metrics["pointing_accuracy"])
        out["pointing_queries"] = record.get("num_pointing_queries")
    if record.get("protocol") == "phrase_localization" and "r1" in metrics:
        out["box_r1"] = float(metrics["r1"])
        out["box_phrases"] = int(metrics.get("num_phrases", record.get("num_test_phrases", 0)))
    return out


def chance_cells(record: dict) -> dict:
    """The record's chance level (random embeddings on the same split and protocol)."""
    chance = record.get("random_baseline") or (record.get("metrics") or {}).get("random_baseline") or {}
    return {k: float(chance[k]) for k in RETRIEVAL_KEYS if k in chance}


def summarize(values: Sequence[float | None]) -> dict | None:
    """Mean and sample standard deviation (ddof 1; 0 for one seed) of the seeds' values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
            "n": len(vals), "values": vals}


def split_identity(record: dict) -> tuple:
    return (record.get("protocol"), record.get("test_split_fingerprint"))


def assemble(system_runs: dict[str, list[dict]]) -> dict:
    """Aggregates the seeds' runs of every system into leaderboard rows.

    `system_runs[key]`: one entry per seed, each {"retrieval": run or {"error": reason},
    "grounding": run, {"error": reason} or None}, a run being {"record", "cost", "reused"}.
    Returns {"rows": [...], "split": {...}, "apart": [...]}: the rows measured on the reference
    (protocol, test split) — the one most systems share — and, apart, every row measured
    otherwise (never put in the table).
    """
    identities: dict[tuple, int] = {}
    for runs in system_runs.values():
        for entry in runs:
            rec = (entry.get("retrieval") or {}).get("record")
            if rec:
                identities[split_identity(rec)] = identities.get(split_identity(rec), 0) + 1
    reference = max(identities, key=identities.get) if identities else (None, None)
    grounding_sets: dict[str, set] = {}
    rows, apart = [], []
    for system in SYSTEMS:
        runs = system_runs.get(system.key)
        if runs is None:
            continue
        row = {"key": system.key, "name": system.name, "family": system.family,
               "flagfile": system.retrieval.flagfile, "seeds": len(runs), "cells": {}, "notes": [],
               "reused": all((run or {}).get("reused", True) for e in runs
                             for run in (e.get("retrieval"), e.get("grounding")))}
        errors = [e["retrieval"]["error"] for e in runs if "error" in (e.get("retrieval") or {})]
        records = [e["retrieval"]["record"] for e in runs if "record" in (e.get("retrieval") or {})]
        if errors:
            row["unavailable"] = errors[0]
        differing = [r for r in records if split_identity(r) != reference]
        if differing:
            apart.append({"key": system.key, "name": system.name, "protocol": differing[0].get("protocol"),
                          "test_split_fingerprint": differing[0].get("test_split_fingerprint"),
                          "metrics": retrieval_cells(differing[0])})
            row["unavailable"] = (f"measured on another split or protocol ({differing[0].get('protocol')}, "
                                  f"{differing[0].get('test_split_fingerprint')}): listed apart")
            records = []
        for key in RETRIEVAL_KEYS:
            row["cells"][key] = summarize([retrieval_cells(r).get(key) for r in records])
        row["chance"] = chance_cells(records[0]) if records else {}
        costs = [e["retrieval"]["cost"] for e in runs if "cost" in (e.get("retrieval") or {})]
        grounding = [e.get("grounding") for e in runs]
        g_records = [g["record"] for g in grounding if g and "record" in g]
        g_cells = [grounding_cells(r) for r in (g_records or records)]
        for key in GROUNDING_KEYS:
            row["cells"][key] = summarize([c.get(key) for c in g_cells])
        for c, r in zip(g_cells, g_records or records):
            if "pointing" in c or "box_r1" in c:
                grounding_sets.setdefault(system.key, set()).add(
                    (r.get("test_split_fingerprint"), c.get("pointing_queries") or c.get("box_phrases")))
        g_errors = [g["error"] for g in grounding if g and "error" in g]
        if g_errors:
            row["grounding_unavailable"] = g_errors[0]
        elif system.no_grounding:
            row["grounding_unavailable"] = system.no_grounding
        elif records and records[0].get("pointing_not_computed"):
            row["grounding_unavailable"] = records[0]["pointing_not_computed"]
        g_costs = [g["cost"] for g in grounding if g and "cost" in g]
        row["cells"]["params"] = summarize([c["params"] for c in costs])
        row["cells"]["train_s"] = summarize([c["train_s"] for c in costs])
        row["cells"]["eval_s"] = summarize([c["eval_s"] for c in costs])
        if g_costs:
            row["grounding_cost"] = {k: summarize([c[k] for c in g_costs]) for k in COST_KEYS}
        row["protocol"], row["test_split_fingerprint"] = split_identity(records[0]) if records else (None, None)
        row["grounding_fingerprint"] = g_records[0].get("test_split_fingerprint") if g_records else (
            row["test_split_fingerprint"] if row["cells"]["pointing"] else None)
        rows.append(row)
    first = next((e["retrieval"]["record"] for runs in system_runs.values() for e in runs
                  if "record" in (e.get("retrieval") or {}) and split_identity(e["retrieval"]["record"]) == reference),
                 {})
    split = {"protocol": reference[0], "test_split_fingerprint": reference[1],
             "num_test_images": first.get("num_test_images"), "num_test_captions": first.get("num_test_captions")}
    return {"rows": rows, "split": split, "apart": apart,
            "grounding_sets": {k: sorted(map(list, v), key=str) for k, v in grounding_sets.items()}}


# ---------------------------------------------------------------------------- output


def _cell(summary: dict | None, key: str) -> str:
    if summary is None:
        return "–"
    digits = 0 if key in ("params", "i2t_medr", "t2i_medr") or key.endswith("_s") else 1
    if key == "params":
        text = f"{summary['mean'] / 1e6:.2f}M" if summary["mean"] >= 1e5 else f"{summary['mean']:.0f}"
    else:
        text = f"{summary['mean']:.{digits}f}"
    if summary["n"] > 1 and key != "params":
        text += f"±{summary['std']:.{digits}f}"
    return text


def format_table(board: dict, *, dataset: str, seeds: Sequence[int], footer: Sequence[str] = ()) -> str:
    """The one table: retrieval both ways, rsum, grounding, cost; footnotes for every '–'."""
    split = board["split"]
    keys = [*RETRIEVAL_KEYS, *GROUNDING_KEYS, *COST_KEYS]
    table = [[r["name"] + (" (reused)" if r["reused"] else "")] + [_cell(r["cells"].get(k), k) for k in keys]
             for r in board["rows"]]
    notes: list[str] = []

    def mark(row_index: int, columns: Sequence[str], reason: str) -> None:
        number = notes.index(reason) + 1 if reason in notes else (notes.append(reason) or len(notes))
        for k in columns:
            i = keys.index(k) + 1
            if table[row_index][i] == "–":
                table[row_index][i] = f"–{number}"

    for i, r in enumerate(board["rows"]):
        if r.get("unavailable"):
            mark(i, keys, f"{r['name']}: {r['unavailable']}")
        if r.get("grounding_unavailable"):
            mark(i, GROUNDING_KEYS, f"{r['name']}: {r['grounding_unavailable']}")
        if r["cells"].get("pointing") and not r["cells"].get("box_r1"):
            mark(i, ["box_r1"], "heat-map systems rank no boxes: no R@1 at IoU 0.5")
        if r["cells"].get("box_r1") and not r["cells"].get("pointing"):
            mark(i, ["pointing"], "box-ranking systems: the pointing game of their top box is not computed")
        if r["cells"].get("params") is None and not r.get("unavailable"):
            mark(i, ["params", "train_s", "eval_s"], f"{r['name']}: nothing is trained")
    header = ["System"] + [COLUMNS[k] for k in keys]
    widths = [max(len(str(row[c])) for row in [header, *table]) for c in range(len(header))]
    line = lambda cells: " | ".join(f"{c:<{widths[0]}}" if j == 0 else f"{c:>{widths[j]}}"  # noqa: E731
                                    for j, c in enumerate(cells))
    title = (f"Leaderboard on {dataset}: test split {split['test_split_fingerprint']} "
             f"({split['num_test_images']} images, {split['num_test_captions']} captions), protocol "
             f"{split['protocol']}; mean ± std over seeds {list(seeds)}")
    out = [title, "=" * len(line(header)), line(header), "-" * len(line(header)), *map(line, table),
           "-" * len(line(header))]
    chance = next((r["chance"] for r in board["rows"] if r.get("chance")), {})
    if chance:
        out.append("chance (random embeddings, same split and protocol): " +
                   ", ".join(f"{COLUMNS[k]} {chance[k]:.1f}" for k in RETRIEVAL_KEYS if k in chance))
    out.append(GROUNDING_RULE + ". Phrases per system (the fingerprint of the run's test split or, for the region runs, of its test images and phrases: number of phrases): " + "; ".join(
        f"{k}: {', '.join(f'{fp}: {n}' for fp, n in v)}" for k, v in board["grounding_sets"].items()))
    out.append("cost: params = every weight of the trained model (frozen CNNs included; CCA: its "
               "projections and means); train s = seconds inside training calls; eval s = seconds from "
               "the end of training to the end of the row (scoring the test split, writing the record); "
               "grounding runs' cost is in the JSON. Retrieval and cost cells are the retrieval run's.")
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    for a in board["apart"]:
        out.append(f"NOT COMPARABLE (listed apart, not in the table): {a['name']}: protocol {a['protocol']}, "
                   f"split {a['test_split_fingerprint']}, rsum {a['metrics'].get('rsum', float('nan')):.1f}")
    out += list(footer)
    return "\n".join(out)


def write_csv(path: pathlib.Path, board: dict) -> pathlib.Path:
    """One line per system: mean and std of every cell, protocol, fingerprints, reasons."""
    keys = [*RETRIEVAL_KEYS, *GROUNDING_KEYS, *COST_KEYS]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["key", "name", "seeds", "protocol", "test_split_fingerprint", "grounding_fingerprint",
                     *(f"{k}_{s}" for k in keys for s in ("mean", "std")), "unavailable",
                     "grounding_unavailable", "reused"])
    for r in board["rows"]:
        cells = [("" if r["cells"].get(k) is None else f"{r['cells'][k][s]:.4g}") for k in keys
                 for s in ("mean", "std")]
        writer.writerow([r["key"], r["name"], r["seeds"], r["protocol"], r["test_split_fingerprint"],
                         r["grounding_fingerprint"], *cells, r.get("unavailable", ""),
                         r.get("grounding_unavailable", ""), r["reused"]])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    tmp.replace(path)
    return path


def write_figure(path: pathlib.Path, board: dict, title: str) -> pathlib.Path:
    """rsum and grounding accuracy per system, the seeds' standard deviation as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = board["rows"]
    names = [r["key"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))

    def bars(ax, key, offset, width, label):
        mean = [(r["cells"].get(key) or {}).get("mean", np.nan) for r in rows]
        std = [(r["cells"].get(key) or {}).get("std", 0.0) for r in rows]
        ax.bar(np.arange(len(rows)) + offset, np.nan_to_num(mean), width, yerr=std, capsize=3, label=label)

    bars(axes[0], "rsum", 0.0, 0.6, "rsum")
    chance = next((r["chance"].get("rsum") for r in rows if r.get("chance")), None)
    if chance is not None:
        axes[0].axhline(chance, color="grey", linestyle="--", label="chance")
    axes[0].set_title("retrieval rsum (R@1+5+10 both ways)")
    bars(axes[1], "pointing", -0.2, 0.4, "pointing game %")
    bars(axes[1], "box_r1", 0.2, 0.4, "box R@1 (IoU ≥ 0.5) %")
    axes[1].set_title("grounding on Entities test phrases")
    for ax in axes:
        ax.set_xticks(np.arange(len(rows)), names, rotation=30, ha="right")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def write_outputs(out_dir: pathlib.Path, board: dict, table: str, meta: dict) -> dict:
    """leaderboard.json, leaderboard.csv, leaderboard.png and leaderboard.txt in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "leaderboard.json", "csv": out_dir / "leaderboard.csv",
             "png": out_dir / "leaderboard.png", "txt": out_dir / "leaderboard.txt"}
    json_files.write_json(paths["json"], {**meta, **board, "table": table})
    write_csv(paths["csv"], board)
    write_figure(paths["png"], board, f"{meta.get('dataset', '')} - {board['split']['test_split_fingerprint']}")
    paths["txt"].write_text(table + "\n", encoding="utf-8")
    return {k: str(v) for k, v in paths.items()}
