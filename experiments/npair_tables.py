"""Tables 1 and 2 of Das et al. from N-pair rows, and the ``--rows`` runner of
``experiments.npair_localization`` (moved out of the experiment; it takes the
experiment's `define_flags` and its one-row runner).

Rows are run in ``<runs_dir>/<flagfile stem>`` (default ``runs/``); a row whose
folder holds results of the same typed flags is not run again (an
interrupted table resumes), and rows that differ only in what is evaluated
share one trained model.
"""
from __future__ import annotations

import pathlib
import time
from typing import Callable

from absl import flags

from experiments import common
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.json_files import read_json_object
from tf_twobranch.pipelines import npair_localization as npair
from tf_twobranch.pipelines.npair_localization import NPairRecipe

__all__ = ["format_table1", "format_table2", "table_row", "format_record", "run_rows", "ROW_ORDER"]


def _paper_pointing(row) -> str:
    paper = row.get("paper")
    return common.format_cell(paper[0], 7, 2) if paper and len(paper) == 1 else f"{'–':>7}"


def format_table2(rows: list[dict], dataset: str) -> str:
    """Table 2's layout: method, pointing accuracy here, the paper's; a row whose pointing
    accuracy could not be computed says why."""
    width = max([len(r["name"]) for r in rows] + [34])
    lines = [f"Das et al. Table 2 analogue: pointing accuracy (%) on {dataset} (paper: Flickr30K Entities test)",
             f"{'Method':{width}} | {'here':>7} | {'paper':>7} | trials",
             "-" * (width + 30)]
    for r in rows:
        pointing = r["metrics"].get("pointing_accuracy")
        trials = f"not computed: {r['not_computed']}" if r.get("not_computed") else r.get("trials")
        trials = "–" if trials is None else trials
        lines.append(f"{r['name']:{width}} | {common.format_cell(pointing, 7, 2)} | {_paper_pointing(r)} | {trials}")
    return "\n".join(lines)


def format_table1(rows: list[dict], dataset: str) -> str:
    """Table 1's layout: R@1/5/10 image-to-caption and caption-to-image, the paper's below when
    measured under the same protocol, chance last; one table per protocol and test split."""
    head = "".join(f"{c:>7}" for c in ("R@1", "R@5", "R@10"))
    tables = []
    for group in common.groups_by_test_split(rows):
        first = group[0]
        width = max([len(r["name"]) for r in group] + [len(common.CHANCE_ROW), 34])
        title = common.table_title(
            "Das et al. Table 1 analogue: retrieval", dataset=dataset, protocol=first["protocol"],
            num_images=first["num_eval_images"], num_captions=first["num_eval_captions"],
            paper=any(r.get("paper") for r in group), paper_dataset=first["paper_dataset"],
            paper_protocol=first["paper_protocol"])
        lines = [title, f"{'':{width}} | {'Image-to-Caption':^21} | {'Caption-to-Image':^21} |",
                 f"{'Model':{width}} | {head} | {head} |", "-" * (width + 50)]

        def line(name, values):
            return (f"{name:{width}} | " + "".join(common.format_cell(v, 7) for v in values[:3]) + " | "
                    + "".join(common.format_cell(v, 7) for v in values[3:6]) + " |")

        keys = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
        for r in group:
            m = r["metrics"]
            lines.append(line(r["name"], [m[k] for k in keys]))
            if "rsum_fold_std" in m:
                lines.append(line(f"  ± std over {m['num_folds']} folds", [m[f"{k}_fold_std"] for k in keys]))
            paper = common.paper_beside(r.get("paper"), r["paper_protocol"], r["protocol"], r["num_eval_images"])
            if paper and len(paper) == 6:
                lines.append(line(f"  (paper: {r['paper_dataset']})", paper))
        lines.append(line(common.CHANCE_ROW, [first["random_baseline"][k] for k in keys]))
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def table_row(record: dict, row) -> dict:
    """A row of the printed tables from a run record and the row's flags."""
    pointing = record.get("pointing") or {}
    chosen = pointing.get(row.parse_mode) or pointing.get("baseline") or {}
    return {"name": row.row_name or record["row"], "metrics": record["metrics"], "trials": chosen.get("trials"),
            "paper": common.paper_numbers(row.paper_results), "paper_dataset": row.paper_dataset,
            "paper_protocol": row.paper_protocol, "protocol": record["protocol"],
            "test_split_fingerprint": record["test_split_fingerprint"],
            "num_eval_images": record["num_eval_images"], "num_eval_captions": record["num_eval_captions"],
            "random_baseline": record.get("random_baseline"), "run_dir": row.run_dir,
            "seconds": record.get("seconds")}


def format_record(record: dict, row) -> str:
    """One row: its retrieval table (Table 1 layout, with chance) and its pointing accuracy
    (Table 2 layout), each beside the paper's number where it measures the same thing."""
    entry = table_row(record, row)
    parts = []
    if "retrieval" in record:
        paper = entry["paper"] if entry["paper"] and len(entry["paper"]) == 6 else None
        parts.append(format_table1([{**entry, "paper": paper}], record["dataset"]))
    if "pointing" in record:
        paper = entry["paper"] if entry["paper"] and len(entry["paper"]) == 1 else None
        parts.append(format_table2([{**entry, "paper": paper}], record["dataset"]))
    if record.get("pointing_not_computed"):
        parts.append(f"pointing game not computed: {record['pointing_not_computed']}")
    return "\n\n".join(parts)


# The rows in the order of the paper's Table 2, then Table 1.
ROW_ORDER = ("random", "centre", "vgg_channel_mean", "untrained", "npair_word", "npair_phrase", "triplet")
_RUNNER_FLAGS = {"rows", "runs_dir", "out_json", "run_dir", "row_name", "paper_results"}
# Flags that only choose what a trained model is evaluated on: rows differing only in them share one run.
_EVALUATION_ONLY = {"parse_mode", "protocol", "paper_dataset", "paper_protocol", "pointing_counting", "row_metric"}


def _row_configs(f) -> list[pathlib.Path]:
    if f.rows == ["all"]:
        def order(cfg):
            table, key = cfg.stem.split("_", 2)[1:]
            return (table != "table2", ROW_ORDER.index(key) if key in ROW_ORDER else len(ROW_ORDER), key)
        return sorted(common.CONFIG_DIR.glob("das_*.cfg"), key=order)
    return [common.resolve_config(name) for name in f.rows]


def _training_key(row) -> tuple:
    typed = common.typed_flags(row)
    return tuple(sorted((k, str(v)) for k, v in typed.items() if k not in _EVALUATION_ONLY | _RUNNER_FLAGS))


def run_rows(f, define_flags: Callable[[flags.FlagValues], None], run_row: Callable[[flags.FlagValues], dict]) -> dict:
    """Runs the rows of `--rows` and prints Table 2 (pointing) and Table 1 (retrieval).

    `define_flags` defines a row's flags; `run_row(row flags)` runs one row and returns its
    record. Rows that differ only in what is evaluated (parse mode, protocol) share one trained
    model; a row whose run folder already holds results with the same flags is not run again,
    so an interrupted table resumes.
    """
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else common.REPO_ROOT / "runs"
    overrides = common.row_overrides(f, define_flags, _RUNNER_FLAGS)
    trained: dict = {}
    results = {}
    start = time.time()
    for cfg in _row_configs(f):
        row = common.parse_flagfile(define_flags, str(cfg), overrides)
        key = _training_key(row)
        row.run_dir = str(runs_dir / cfg.stem)
        recipe = NPairRecipe.from_flags(row)
        source, layout = npair.dataset_layout(recipe)
        reason = npair.uncomputable_metric(recipe, layout, source)
        if reason:
            # The table says which row is missing and why; nothing is trained for it.
            print(f"--- {cfg.name}: not computed: {reason}", flush=True)
            results[cfg.stem] = {"name": row.row_name, "metrics": {}, "not_computed": reason,
                                 "paper": common.paper_numbers(row.paper_results),
                                 "paper_dataset": row.paper_dataset, "paper_protocol": row.paper_protocol,
                                 "run_dir": None}
            continue
        path = pathlib.Path(row.run_dir) / "results.json"
        previous = read_json_object(path, "N-pair run record") if path.is_file() else None
        if (previous and previous.get("typed_flags") == common.typed_flags(row)
                and "test_split_fingerprint" in previous):
            record = previous
            print(f"--- {cfg.name}: finished before ({row.run_dir})", flush=True)
        elif key in trained:
            record = dict(trained[key])
            record.update(row=row.row_name, paper=common.paper_numbers(row.paper_results),
                          paper_dataset=row.paper_dataset, paper_protocol=row.paper_protocol,
                          shared_with=trained[key]["row"])
            if row.protocol not in record["retrieval"]:
                raise common.UserInputError(f"{cfg.name}: protocol {row.protocol} was not evaluated by the "
                                            f"shared run {trained[key]['row']}")
            record.update(protocol=row.protocol, random_baseline=record["random_baselines"][row.protocol])
            npair.summary(record, recipe)
            print(f"--- {cfg.name}: {row.row_name}: the model of {trained[key]['row']}", flush=True)
        else:
            print(f"--- {cfg.name}: {row.row_name}", flush=True)
            record = run_row(row)
        if record.get("row_kind") in ("model", "untrained") and key not in trained:
            trained[key] = record
        results[cfg.stem] = table_row(record, row)
    dataset = str(load_embedded_dataset()) if not f.dataset_dir else f.dataset_dir
    out = {"rows": results, "seconds": time.time() - start}
    table2 = [r for stem, r in results.items() if stem.startswith("das_table2_")]
    table1 = [r for stem, r in results.items() if stem.startswith("das_table1_") and not r.get("not_computed")]
    if table2:
        out["table2"] = format_table2(table2, dataset)
        print(out["table2"])
    if table1:
        out["table1"] = format_table1(table1, dataset)
        print(out["table1"])
    common.write_json(f.out_json or runs_dir / "das_tables.json", out)
    return out
