"""Tables 1 and 2 of Das et al. from N-pair rows, and the ``--rows`` table of
``experiments.npair`` run through the one table runner
(`tf_twobranch.table_runner`: row selection, flags for every row, resume of an
interrupted table, run folder ``<runs_dir>/<flagfile stem>``, default ``runs/``).

Rows that differ only in what is evaluated (parse mode, protocol, the paper's
labels) share one trained model: the first is trained, the others are its
record evaluated under their own protocol and parse mode (the runner's
``share_key``/``share``), each written to its own run folder.
"""
from __future__ import annotations

import pathlib
import time
from typing import Callable

from absl import flags

from experiments import common
from tf_twobranch import table_runner
from tf_twobranch.data.embedded import load_embedded_dataset
from tf_twobranch.systems.npair import pipeline as npair
from tf_twobranch.systems.npair.pipeline import NPairRecipe
from tf_twobranch.systems.npair.tables import format_table1, format_table2, table_row

__all__ = ["run_rows", "select_rows", "ROW_ORDER"]


# The rows in the order of the paper's Table 2, then Table 1.
ROW_ORDER = ("random", "centre", "vgg_channel_mean", "untrained", "npair_word", "npair_phrase", "triplet")
# The flags of the table runner (and absl's --flagfile): not passed to the rows.
RUNNER_FLAGS = ("rows", "runs_dir", "resume", "out_json", "flagfile")
# Flags that only choose what a trained model is evaluated on, or label it: rows differing only
# in them share one trained model.
_EVALUATION_ONLY = {"parse_mode", "protocol", "paper_dataset", "paper_protocol", "pointing_counting", "point_rule", "row_metric",
                    "paper_results", "row_name", "run_dir", "out_json"}


def select_rows(rows) -> list[pathlib.Path]:
    """--rows: names or paths, or 'all' (every npair_*.cfg: Table 2 in the paper's order, then Table 1)."""
    configs = table_runner.select_rows(rows, pattern="npair_*.cfg")
    if list(rows) != ["all"]:
        return configs

    def order(cfg):
        table, key = cfg.stem.split("_", 2)[1:]
        return (table != "table2", ROW_ORDER.index(key) if key in ROW_ORDER else len(ROW_ORDER), key)
    return sorted(configs, key=order)


def run_rows(f, argv, define_flags: Callable[[flags.FlagValues], None],
             run_row: Callable[[flags.FlagValues], dict]) -> dict:
    """Runs the rows of `f.rows` (each its flagfile + the flags of `argv` that are not
    `RUNNER_FLAGS`; `run_row(row flags)` runs one, `define_flags` defines them) through
    `tf_twobranch.table_runner` and prints Table 2 (pointing) and Table 1 (retrieval). A row
    whose metric the dataset cannot give is marked not computed."""
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else table_runner.default_runs_dir()
    overrides = common.runner_arguments(argv, RUNNER_FLAGS)     # the flags typed here go to every row
    configs = select_rows(f.rows)
    start = time.time()

    def parse(cfg, arguments):
        row = common.parse_flagfile(define_flags, str(cfg), arguments)
        recipe = NPairRecipe.from_flags(row)
        source, layout = npair.dataset_layout(recipe)
        return row, recipe, source, npair.uncomputable_metric(recipe, layout, source)

    def run_one(cfg, arguments):
        row, recipe, source, reason = parse(cfg, arguments)
        if not reason:
            return run_row(row)
        # The table says which row is missing and why; nothing is trained for it.
        print(f"--- {cfg.name}: not computed: {reason}", flush=True)
        return {"row": row.row_name, "name": row.row_name, "metrics": {}, "not_computed": reason,
                "paper": common.paper_numbers(row.paper_results), "paper_dataset": row.paper_dataset,
                "paper_protocol": row.paper_protocol, "dataset": str(source), "run_dir": None}

    def training(cfg, arguments):
        row, recipe, _, reason = parse(cfg, arguments)
        if reason or recipe.row_kind not in ("model", "untrained"):
            return None
        return tuple(sorted((k, str(v)) for k, v in common.typed_flags(row).items()
                            if k not in _EVALUATION_ONLY and k not in RUNNER_FLAGS))

    def share(cfg, arguments, first):
        row, recipe, _, _ = parse(cfg, arguments)
        if row.protocol not in first["retrieval"]:
            raise common.UserInputError(f"{cfg.name}: protocol {row.protocol} was not evaluated by the "
                                        f"shared run {first['row']}")
        record = {**first, "row": row.row_name, "paper": common.paper_numbers(row.paper_results),
                  "paper_dataset": row.paper_dataset, "paper_protocol": row.paper_protocol,
                  "shared_with": first["row"], "trained_in": first.get("trained_in") or first["run_dir"],
                  "run_dir": row.run_dir, "protocol": row.protocol,
                  "random_baseline": first["random_baselines"][row.protocol],
                  "recipe": {**first["recipe"], **{k: getattr(recipe, k) for k in _EVALUATION_ONLY}}}
        npair.summary(record, recipe)
        if common.is_chief():
            common.write_json(pathlib.Path(row.run_dir) / "results.json", record)
        return record

    records = table_runner.run_table(configs, run_one, overrides=overrides, runs_dir=runs_dir, resume=f.resume,
                                     share_key=training, share=share, is_chief=common.is_chief)
    results = {cfg.stem: r if r.get("not_computed") else table_row(r) for cfg, r in zip(configs, records)}
    dataset = str(load_embedded_dataset()) if not f.dataset_dir else f.dataset_dir
    out = {"rows": results, "seconds": time.time() - start}
    table2 = [r for stem, r in results.items() if stem.startswith("npair_table2_")]
    table1 = [r for stem, r in results.items() if stem.startswith("npair_table1_") and not r.get("not_computed")]
    if table2:
        out["table2"] = format_table2(table2, dataset)
        print(out["table2"])
    if table1:
        out["table1"] = format_table1(table1, dataset)
        print(out["table1"])
    common.write_json(f.out_json or runs_dir / "npair_tables.json", out)
    trained = [r for r in records if r.get("row_kind") in ("model", "untrained")]
    if trained:
        print(follow_up(trained[-1]))
    return out


def follow_up(record: dict) -> str:
    """What to run next on a trained row's run folder (npair_draw, load_run)."""
    run_dir = record.get("trained_in") or record["run_dir"]
    if record.get("row_kind") not in ("model", "untrained"):
        return table_runner.next_command(run_dir, load_run=False)
    return table_runner.next_command(
        run_dir, f"python -m experiments.npair_draw --run_dir={run_dir} --out_dir=figures --image_index=0,1,2")
