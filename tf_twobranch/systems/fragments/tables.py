"""Karpathy et al.'s Tables 2 and 3 layout (R@1, R@5, R@10, Med r of annotation and search, rsum) for the
fragment rows' records (`experiments.fragments_tables` prints the ``--rows`` table with it)."""
from __future__ import annotations

from tf_twobranch.tables import CHANCE_ROW, format_cell, is_smoke, paper_beside_record, table_title

__all__ = ["PAPER_LAYOUT", "format_rows", "format_record"]

PAPER_LAYOUT = ("R@1", "R@5", "R@10", "Med r")


def format_rows(title: str, rows: list[dict], chance: dict | None = None) -> str:
    """The paper's Table 2/3 layout: R@1, R@5, R@10, Med r of annotation and search, rsum.

    A row's "paper" (8 numbers; None for a cell the paper lacks) is printed
    below it; `chance` (the random baseline's metrics) ends the table.
    """
    rows = [*rows, {"name": CHANCE_ROW, "metrics": chance}] if chance else list(rows)
    width = max([len(r["name"]) for r in rows] + [30])
    head = "".join(f"{c:>7}" for c in PAPER_LAYOUT)
    lines = [title, f"{'':{width}} | {'Image Annotation':^28} | {'Image Search':^28} |",
             f"{'Model':{width}} | {head} | {head} |   rsum", "-" * (width + 72)]

    def cells(values):
        return "".join(format_cell(v, 7, 1 if i % 4 < 3 else 0) for i, v in enumerate(values))

    def line(name, values):
        recalls = values[:3] + values[4:7]
        rsum = None if any(v is None for v in recalls) else sum(recalls)
        return f"{name:{width}} | {cells(values[:4])} | {cells(values[4:8])} | {format_cell(rsum, 6)}"

    for r in rows:
        m = r["metrics"]
        lines.append(line(r["name"], [m["i2t_r1"], m["i2t_r5"], m["i2t_r10"], m["i2t_medr"],
                                      m["t2i_r1"], m["t2i_r5"], m["t2i_r10"], m["t2i_medr"]]))
        if r.get("paper") and len(r["paper"]) == 8:
            lines.append(line("  (paper)", list(r["paper"])))
    return "\n".join(lines)


def format_record(record: dict) -> str:
    """One row beside the paper's numbers (when measured under the same protocol) and chance."""
    paper = paper_beside_record(record)
    title = table_title(record["row"], protocol=record["protocol"],
                               num_images=record["num_eval_images"], num_captions=record["num_eval_captions"],
                               paper=record["paper"], paper_dataset=record["paper_dataset"],
                               paper_protocol=record["paper_protocol"], smoke=is_smoke(record))
    return format_rows(title, [{"name": record["row"], "metrics": record["metrics"], "paper": paper}],
                       chance=record.get("random_baseline"))
