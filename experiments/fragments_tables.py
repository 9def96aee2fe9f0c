"""The tables of Karpathy et al. (NIPS 2014), Tables 2 and 3: their layout, and the `--rows` table of
`experiments.fragments` run through the one table runner (`tf_twobranch.table_runner`:
row selection, flags for every row, resume, run folder ``<runs_dir>/<flagfile stem>``).

A Table 3 row whose flags differ from its Table 2 twin's only in the paper's labels (on one
dataset folder, e.g. the embedded data) shares the twin's trained model instead of training again.
"""
from __future__ import annotations

import pathlib
from typing import Callable

from absl import flags

from experiments import common
from tf_twobranch import table_runner
from tf_twobranch.systems.fragments.tables import format_rows

# The rows in the order of the paper's tables.
ROW_ORDER = ("random_ranking", "devise", "fragment_objective", "global_objective", "fragment_global",
             "fullframe_only", "bow", "bigrams", "fragment_global_mil", "fine_tuned_cnn",
             "star_fragment_global_mil")
# The flags of the table runner (and absl's --flagfile): not passed to the rows.
RUNNER_FLAGS = ("rows", "table", "runs_dir", "resume", "out_json", "flagfile")
# Flags that only label a row beside the paper: rows differing only in them share one trained model.
_LABELS = {"row_name", "paper_results", "paper_dataset", "paper_protocol", "run_dir", "out_json"}


def _paper_order(cfg: pathlib.Path):
    key = cfg.stem.split("_", 2)[2]
    return (cfg.stem.split("_", 2)[1], ROW_ORDER.index(key) if key in ROW_ORDER else len(ROW_ORDER), key)


def select_rows(rows, table: str = "all") -> list[pathlib.Path]:
    """--rows: names or paths, or 'all' (every fragments_table<table>_*.cfg, in the paper's order)."""
    configs = table_runner.select_rows(rows, pattern=f"fragments_table{'*' if table == 'all' else table}_*.cfg")
    return sorted(configs, key=_paper_order) if list(rows) == ["all"] else configs


def _entry(record: dict, run_dir: pathlib.Path) -> dict:
    """A row of the printed tables from its run record."""
    paper = record["paper"]
    return {"name": record["row"], "metrics": record["metrics"], "paper": paper,
            "paper_dataset": record["paper_dataset"], "paper_protocol": record["paper_protocol"],
            "paper_beside": common.paper_beside_record(record), "smoke": common.is_smoke(record),
            **{k: record[k] for k in ("protocol", "test_split_fingerprint", "num_eval_images",
                                      "num_eval_captions", "random_baseline", "seconds")},
            "run_dir": str(run_dir)}


def run_rows(f, argv, define_flags: Callable[[flags.FlagValues], None],
             run: Callable[[flags.FlagValues], dict]) -> dict:
    """Runs the rows of `f.rows` (each its flagfile + the flags of `argv` that are not
    `RUNNER_FLAGS`; `run` of its flags defined by `define_flags`) through
    `tf_twobranch.table_runner` and prints Tables 2 and 3."""
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else table_runner.default_runs_dir()
    overrides = common.runner_arguments(argv, RUNNER_FLAGS)     # the flags typed here go to every row
    configs = select_rows(f.rows, f.table)

    def parse(cfg, arguments):
        return common.parse_flagfile(define_flags, str(cfg), arguments)

    def training(cfg, arguments):
        typed = common.typed_flags(parse(cfg, arguments))
        return tuple(sorted((k, str(v)) for k, v in typed.items() if k not in _LABELS))

    def share(cfg, arguments, first):
        row = parse(cfg, arguments)
        record = {**first, "row": row.row_name, "paper": common.paper_numbers(row.paper_results),
                  "paper_dataset": row.paper_dataset, "paper_protocol": row.paper_protocol,
                  "shared_with": first["row"], "run_dir": row.run_dir,
                  "trained_in": first.get("trained_in") or first.get("run_dir")}
        if common.is_chief():
            common.write_json(pathlib.Path(row.run_dir) / "results.json", record)
        return record

    records = table_runner.run_table(
        configs, lambda cfg, arguments: run(parse(cfg, arguments)), overrides=overrides, runs_dir=runs_dir,
        resume=f.resume, share_key=training, share=share, is_chief=common.is_chief)
    results = {cfg.stem: _entry(r, table_runner.run_folder(runs_dir, cfg)) for cfg, r in zip(configs, records)}
    out = {"rows": results}
    for table, dataset in (("2", "Flickr8K"), ("3", "Flickr30K")):
        rows = [r for stem, r in results.items() if stem.startswith(f"fragments_table{table}_")]
        texts = []
        for group in common.groups_by_test_split(rows):
            first = group[0]
            title = common.table_title(
                f"Karpathy et al. Table {table} rows", dataset=records[0]["dataset"],
                protocol=first["protocol"], num_images=first["num_eval_images"],
                num_captions=first["num_eval_captions"], paper=any(r["paper"] for r in group),
                paper_dataset=dataset, paper_protocol=first["paper_protocol"],
                smoke=any(common.is_smoke(r) for r in group))
            texts.append(format_rows(title, [{**r, "paper": r["paper_beside"]} for r in group],
                                     chance=first["random_baseline"]))
        if texts:
            text = "\n\n".join(texts)
            print(text)
            out[f"table{table}"] = text
    common.write_json(f.out_json or runs_dir / "fragments_tables.json", out)
    drawable = [r for r in records if r["recipe"]["representation"] == "fragments"
                and not r["recipe"]["random_ranking"]]
    print(follow_up((drawable or records)[-1]))
    return out


def follow_up(record: dict) -> str:
    """What to run next on a row's run folder (fragments_draw, load_run)."""
    run_dir, recipe = record.get("trained_in") or record["run_dir"], record["recipe"]
    if recipe["random_ranking"] or recipe["representation"] != "fragments":   # nothing to draw
        return table_runner.next_command(run_dir, load_run=not recipe["random_ranking"])
    return table_runner.next_command(
        run_dir, f"python -m experiments.fragments_draw --run_dir={run_dir} --out_dir=figures --top_sentences=5")
