"""Das et al.'s Tables 1 and 2 layout for the N-pair rows' records: retrieval R@1/5/10 both ways
(Table 1) and the pointing accuracy (Table 2), each beside the paper's number where it measures the
same thing (`experiments.npair_tables` prints the ``--rows`` tables with it)."""
from __future__ import annotations

from tf_twobranch.tables import (CHANCE_ROW, format_cell, groups_by_test_split, is_smoke, paper_beside_record,
                                 table_title)

__all__ = ["format_table1", "format_table2", "table_row", "format_record"]


def _paper_pointing(row) -> str:
    paper = row.get("paper")
    return format_cell(paper[0], 7, 2) if paper and len(paper) == 1 else f"{'–':>7}"


def format_table2(rows: list[dict], dataset: str) -> str:
    """Table 2's layout: method, pointing accuracy here, the paper's; a row whose pointing
    accuracy could not be computed says why."""
    width = max([len(r["name"]) for r in rows] + [34])
    rules = sorted({r.get("point_rule") for r in rows if r.get("point_rule")})
    rule_line = ("heat maps point at " + (" / ".join(f"--point_rule={x}" for x in rules) if rules else "–")
                 + "; the 'argmax' column: the first maximal pixel of the upsampled map (the authors' code); "
                 "random and centre points take no rule")
    lines = [f"Das et al. Table 2 analogue: pointing accuracy (%) on {dataset} (paper: Flickr30K Entities test)",
             rule_line,
             f"{'Method':{width}} | {'here':>7} | {'argmax':>7} | {'paper':>7} | trials",
             "-" * (width + 40)]
    for r in rows:
        pointing = r["metrics"].get("pointing_accuracy")
        by_rule = (r.get("accuracy_by_point_rule") or {}).get("argmax")
        trials = f"not computed: {r['not_computed']}" if r.get("not_computed") else r.get("trials")
        trials = "–" if trials is None else trials
        lines.append(f"{r['name']:{width}} | {format_cell(pointing, 7, 2)} | "
                     f"{format_cell(by_rule, 7, 2)} | {_paper_pointing(r)} | {trials}")
    return "\n".join(lines)


def format_table1(rows: list[dict], dataset: str) -> str:
    """Table 1's layout: R@1/5/10 image-to-caption and caption-to-image, the paper's below when
    measured under the same protocol, chance last; one table per protocol and test split."""
    head = "".join(f"{c:>7}" for c in ("R@1", "R@5", "R@10"))
    tables = []
    for group in groups_by_test_split(rows):
        first = group[0]
        width = max([len(r["name"]) for r in group] + [len(CHANCE_ROW), 34])
        title = table_title(
            "Das et al. Table 1 analogue: retrieval", dataset=dataset, protocol=first["protocol"],
            num_images=first["num_eval_images"], num_captions=first["num_eval_captions"],
            paper=any(r.get("paper") for r in group), paper_dataset=first["paper_dataset"],
            paper_protocol=first["paper_protocol"], smoke=any(is_smoke(r) for r in group))
        lines = [title, f"{'':{width}} | {'Image-to-Caption':^21} | {'Caption-to-Image':^21} |",
                 f"{'Model':{width}} | {head} | {head} |", "-" * (width + 50)]

        def line(name, values):
            return (f"{name:{width}} | " + "".join(format_cell(v, 7) for v in values[:3]) + " | "
                    + "".join(format_cell(v, 7) for v in values[3:6]) + " |")

        keys = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
        for r in group:
            m = r["metrics"]
            lines.append(line(r["name"], [m[k] for k in keys]))
            if "rsum_fold_std" in m:
                lines.append(line(f"  ± std over {m['num_folds']} folds", [m[f"{k}_fold_std"] for k in keys]))
            paper = paper_beside_record(r, num_test_images=r["num_eval_images"])
            if paper and len(paper) == 6:
                lines.append(line(f"  (paper: {r['paper_dataset']})", paper))
        lines.append(line(CHANCE_ROW, [first["random_baseline"][k] for k in keys]))
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def table_row(record: dict) -> dict:
    """A row of the printed tables from its run record (its recipe says the parse mode shown)."""
    pointing = record.get("pointing") or {}
    chosen = pointing.get(record.get("recipe", {}).get("parse_mode")) or pointing.get("baseline") or {}
    return {"name": record["row"], "metrics": record["metrics"], "trials": chosen.get("trials"),
            "point_rule": chosen.get("point_rule"), "accuracy_by_point_rule": chosen.get("accuracy_by_point_rule"),
            "paper": record.get("paper"), "paper_dataset": record["paper_dataset"],
            "paper_protocol": record["paper_protocol"], "protocol": record["protocol"],
            "test_split_fingerprint": record["test_split_fingerprint"],
            "num_eval_images": record["num_eval_images"], "num_eval_captions": record["num_eval_captions"],
            "random_baseline": record.get("random_baseline"), "run_dir": record.get("run_dir"),
            "seconds": record.get("seconds")}


def format_record(record: dict) -> str:
    """One row: its retrieval table (Table 1 layout, with chance) and its pointing accuracy
    (Table 2 layout), each beside the paper's number where it measures the same thing."""
    entry = table_row(record)
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
