"""The tables of Karpathy et al. (NIPS 2014), Tables 2 and 3: their layout and the `--rows` runner
of `experiments.fragment_embeddings` (a row's run folder is ``<runs_dir>/karpathy_<row>``; a table resumes).
"""
from __future__ import annotations

import pathlib
from typing import Callable

from absl import flags

from experiments import common
from tf_twobranch.json_files import read_json_object

PAPER_LAYOUT = ("R@1", "R@5", "R@10", "Med r")


def format_rows(title: str, rows: list[dict], chance: dict | None = None) -> str:
    """The paper's Table 2/3 layout: R@1, R@5, R@10, Med r of annotation and search, rsum.

    A row's "paper" (8 numbers; None for a cell the paper lacks) is printed
    below it; `chance` (the random baseline's metrics) ends the table.
    """
    rows = [*rows, {"name": common.CHANCE_ROW, "metrics": chance}] if chance else list(rows)
    width = max([len(r["name"]) for r in rows] + [30])
    head = "".join(f"{c:>7}" for c in PAPER_LAYOUT)
    lines = [title, f"{'':{width}} | {'Image Annotation':^28} | {'Image Search':^28} |",
             f"{'Model':{width}} | {head} | {head} |   rsum", "-" * (width + 72)]

    def cells(values):
        return "".join(common.format_cell(v, 7, 1 if i % 4 < 3 else 0) for i, v in enumerate(values))

    def line(name, values):
        recalls = values[:3] + values[4:7]
        rsum = None if any(v is None for v in recalls) else sum(recalls)
        return f"{name:{width}} | {cells(values[:4])} | {cells(values[4:8])} | {common.format_cell(rsum, 6)}"

    for r in rows:
        m = r["metrics"]
        lines.append(line(r["name"], [m["i2t_r1"], m["i2t_r5"], m["i2t_r10"], m["i2t_medr"],
                                      m["t2i_r1"], m["t2i_r5"], m["t2i_r10"], m["t2i_medr"]]))
        if r.get("paper") and len(r["paper"]) == 8:
            lines.append(line("  (paper)", list(r["paper"])))
    return "\n".join(lines)


def format_record(record: dict) -> str:
    """One row beside the paper's numbers (when measured under the same protocol) and chance."""
    paper = common.paper_beside(record["paper"], record["paper_protocol"], record["protocol"],
                                record["num_eval_images"])
    title = common.table_title(record["row"], protocol=record["protocol"],
                               num_images=record["num_eval_images"], num_captions=record["num_eval_captions"],
                               paper=record["paper"], paper_dataset=record["paper_dataset"],
                               paper_protocol=record["paper_protocol"])
    return format_rows(title, [{"name": record["row"], "metrics": record["metrics"], "paper": paper}],
                       chance=record.get("random_baseline"))


# The rows in the order of the paper's tables.
ROW_ORDER = ("random_ranking", "devise", "fragment_objective", "global_objective", "fragment_global",
             "fullframe_only", "bow", "bigrams", "fragment_global_mil", "fine_tuned_cnn",
             "star_fragment_global_mil")


def _paper_order(cfg: pathlib.Path):
    key = cfg.stem.split("_", 2)[2]
    return (cfg.stem.split("_", 2)[1], ROW_ORDER.index(key) if key in ROW_ORDER else len(ROW_ORDER), key)


def _row_configs(f) -> list[pathlib.Path]:
    if f.rows == ["all"]:
        tables = ["2", "3"] if f.table == "all" else [f.table]
        return sorted((c for t in tables for c in common.CONFIG_DIR.glob(f"karpathy_table{t}_*.cfg")),
                      key=_paper_order)
    return [common.resolve_config(name) for name in f.rows]


_RUNNER_FLAGS = {"rows", "table", "runs_dir", "out_json", "run_dir", "row_name", "paper_results"}


def _finished(row) -> dict | None:
    """The results of a row already trained in its run folder with the same flags (a table resumes)."""
    path = pathlib.Path(row.run_dir) / "results.json"
    if not path.is_file():
        return None
    record = read_json_object(path, "fragment-embedding run record")
    same = record.get("typed_flags") == common.typed_flags(row)
    # Records written before protocols were checked and fingerprinted are run again.
    return record if same and "metrics" in record and "test_split_fingerprint" in record else None


def run_rows(f, define_flags: Callable[[flags.FlagValues], None], run: Callable[[flags.FlagValues], dict]) -> dict:
    """Runs the rows of `--rows` (`run` of each row's flags, defined by `define_flags`) and prints the tables.

    Each row runs once (a row shared by both tables is trained once); a row
    whose run folder already holds its results with the same flags is not
    trained again, so an interrupted table resumes.
    """
    configs = _row_configs(f)
    overrides = common.row_overrides(f, define_flags, _RUNNER_FLAGS)
    runs_dir = pathlib.Path(f.runs_dir) if f.runs_dir else common.REPO_ROOT / "runs"
    results, done = {}, {}
    for cfg in configs:
        row = common.parse_flagfile(define_flags, str(cfg), overrides)
        key = cfg.stem.split("_", 2)[2]          # the row without its table: shared by Tables 2 and 3
        row.run_dir = str(runs_dir / f"karpathy_{key}")
        if key not in done:
            done[key] = _finished(row) or None
            if done[key] is None:
                print(f"--- {cfg.name}: {row.row_name}", flush=True)
                done[key] = run(row)
            else:
                print(f"--- {cfg.name}: {row.row_name}: finished before, results of {row.run_dir}", flush=True)
        record = done[key]
        paper = common.paper_numbers(row.paper_results)
        results[cfg.stem] = {"name": row.row_name, "metrics": record["metrics"], "paper": paper,
                             "paper_dataset": row.paper_dataset, "paper_protocol": row.paper_protocol,
                             "paper_beside": common.paper_beside(paper, row.paper_protocol, record["protocol"],
                                                                  record["num_eval_images"]),
                             "protocol": record["protocol"],
                             "test_split_fingerprint": record["test_split_fingerprint"],
                             "num_eval_images": record["num_eval_images"],
                             "num_eval_captions": record["num_eval_captions"],
                             "random_baseline": record["random_baseline"],
                             "run_dir": row.run_dir, "seconds": record["seconds"]}
    out = {"rows": results}
    for table, dataset in (("2", "Flickr8K"), ("3", "Flickr30K")):
        rows = [r for stem, r in results.items() if stem.startswith(f"karpathy_table{table}_")]
        texts = []
        for group in common.groups_by_test_split(rows):
            first = group[0]
            title = common.table_title(
                f"Karpathy et al. Table {table} rows", dataset=done and next(iter(done.values()))["dataset"],
                protocol=first["protocol"], num_images=first["num_eval_images"],
                num_captions=first["num_eval_captions"], paper=any(r["paper"] for r in group),
                paper_dataset=dataset, paper_protocol=first["paper_protocol"])
            texts.append(format_rows(title, [{**r, "paper": r["paper_beside"]} for r in group],
                                     chance=first["random_baseline"]))
        if texts:
            text = "\n\n".join(texts)
            print(text)
            out[f"table{table}"] = text
    common.write_json(f.out_json or runs_dir / "karpathy_tables.json", out)
    return out
