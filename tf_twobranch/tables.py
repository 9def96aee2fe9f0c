"""Results records and tables shared by every experiment family: the protocol a split is scored
under, its fingerprint, the paper's numbers beside a result measured the same way, and the
paper-layout retrieval table (no flags: these take a recipe or plain values)."""
from __future__ import annotations

import numpy as np
from absl import logging

from tf_twobranch.data.corpus import split_fingerprint
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval


def paper_numbers(text: str) -> list[float | None] | None:
    """--paper_results as numbers; "nan" marks a cell the paper does not report (None)."""
    if not text:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise UserInputError(f"--paper_results must be comma-separated numbers, got {text!r}") from None
    return [None if np.isnan(v) else v for v in values]


# ------------------------------------------------------------------ protocols


def resolve_protocol(f, num_test_images: int, *, split: str = "the test split") -> dict:
    """Checks --protocol against the test split it is applied to; the record's entries naming it.

    A protocol that does not fit is refused (its name, the test-split size it
    needs and the size found), except on the embedded data (no --dataset_dir),
    whose 1,000-image test split is too small for the shipped COCO rows: there
    the split is scored under "full" (one gallery) and the record says so
    (`requested_protocol`, `protocol_note`); --protocol is set to "full".
    """
    reason = retrieval.protocol_mismatch(f.protocol, num_test_images, split=split)
    if reason is None:
        return {"protocol": f.protocol}
    if f.dataset_dir:
        retrieval.check_protocol(f.protocol, num_test_images, split=split)
    note = (f"embedded dataset: {reason}; scored under protocol full (one gallery of "
            f"{num_test_images} images) instead")
    logging.warning("%s", note)
    requested, f.protocol = f.protocol, "full"
    return {"protocol": "full", "requested_protocol": requested, "protocol_note": note}


def split_record(protocol_entries: dict, corpus) -> dict:
    """`protocol`, `test_split_fingerprint` and the split's size, for a results record.

    `corpus`: the evaluated split, anything with `image_ids`, `captions` and
    `caption_image` (a `CaptionCorpus`, the dual path's data).
    Two results are comparable only when both agree: the same protocol on the
    same ordered images and captions.
    """
    fingerprint = split_fingerprint(corpus.image_ids, corpus.captions, corpus.caption_image)
    return {**protocol_entries, "test_split_fingerprint": fingerprint,
            "num_test_images": corpus.num_images, "num_test_captions": corpus.num_captions}


SMOKE_LINE = "smoke run: not a result"

# The test-split size of the papers' datasets whose protocol ("full": one gallery of the whole
# test split) does not fix it: a result on another size is not put beside their numbers.
PAPER_TEST_IMAGES = {"CUHK-PEDES": 1000, "Flickr30K Entities": 1000}


def is_smoke(record: dict) -> bool:
    """Whether a results record is of a --smoke run (a check that the row runs, not a result)."""
    return bool((record.get("flags") or {}).get("smoke") or record.get("smoke"))


def paper_beside(paper, paper_protocol: str, protocol: str, num_test_images: int, *, smoke: bool = False,
                 paper_dataset: str = ""):
    """The paper's numbers if they were measured like this result (the same protocol on a test
    split of the same size), else None; never beside a --smoke run."""
    if not paper or smoke or not retrieval.protocols_agree(protocol, num_test_images, paper_protocol):
        return None
    size = PAPER_TEST_IMAGES.get(paper_dataset)
    if size is not None and retrieval.protocol_spec(paper_protocol).required_images is None and \
            num_test_images != size:
        return None
    return paper


def paper_beside_record(record: dict, paper=None, *, num_test_images: int | None = None):
    """`paper_beside` of a results record (its paper numbers unless `paper` is given)."""
    size = num_test_images or record.get("num_test_images") or record.get("num_eval_images")
    return paper_beside(record.get("paper") if paper is None else paper, record.get("paper_protocol") or "",
                        record.get("protocol") or "", size, smoke=is_smoke(record),
                        paper_dataset=record.get("paper_dataset") or "")


def localization_paper_beside(record: dict):
    """The paper's phrase-localization R@K beside a record only when it is not a --smoke run and
    was measured on the whole Flickr30K Entities test split (1,000 images), as the paper's were."""
    if is_smoke(record) or record.get("num_test_images") != PAPER_TEST_IMAGES["Flickr30K Entities"]:
        return None
    return record.get("paper")


def groups_by_test_split(records: list[dict]) -> list[list[dict]]:
    """Run records grouped by (protocol, test-split fingerprint), in first-seen order: rows are
    put in one table only when they were measured the same way on the same split."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["protocol"], record["test_split_fingerprint"]), []).append(record)
    return list(groups.values())


def table_title(what: str, *, protocol: str, num_images: int, num_captions: int,
                paper=None, paper_dataset: str = "", paper_protocol: str = "",
                dataset: str = "", smoke: bool = False) -> str:
    """A table's title: what it shows, its protocol and test-split size, and whose numbers
    the '(paper)' rows are (or why the paper's numbers are not shown); a --smoke run's title
    ends with the line `SMOKE_LINE`."""
    on = f" on {dataset}" if dataset else ""
    title = (f"{what}{on}; {retrieval.describe_protocol(protocol, num_images)}, "
             f"{num_captions} captions")
    if paper:
        source = f"{paper_dataset or 'the paper'}, protocol {paper_protocol or 'not declared'}"
        if smoke:
            title += f"; the paper's numbers ({source}) are not shown beside a --smoke run"
        elif paper_beside(paper, paper_protocol, protocol, num_images, paper_dataset=paper_dataset):
            title += f"; '(paper)' rows: {source}"
        else:
            title += (f"; the paper's numbers ({source}) are not shown beside a {protocol} result on "
                      f"{num_images} test images")
    return title + (f"\n{SMOKE_LINE}" if smoke else "")


def format_cell(value, width: int = 8, digits: int = 1) -> str:
    """One number of a table; a cell the paper does not report (None, NaN) prints as '–'."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return f"{'–':>{width}}"
    return f"{value:{width}.{digits}f}"


CHANCE_ROW = "chance (random embeddings, same protocol)"


def format_retrieval_table(title: str, rows: list[dict], ks=(1, 5, 10), chance: dict | None = None) -> str:
    """The paper's Table 2/3 layout: image-to-sentence and sentence-to-image R@K.

    Each row dict has "name", "metrics" (ours) and optionally "paper" (six
    numbers in the same order; None for a cell the paper lacks). A fold
    protocol's metrics get a '± std' line with the spread over its folds.
    `chance` (the random baseline's metrics) ends the table.
    """
    cols = [f"R@{k}" for k in ks]
    rows = [*rows, {"name": CHANCE_ROW, "metrics": chance}] if chance else list(rows)
    name_w = max([len(r["name"]) for r in rows] + [24])
    header = (f"{'':{name_w}} | {'Image-to-sentence':^{8 * len(ks)}} | "
              f"{'Sentence-to-image':^{8 * len(ks)}} |")
    sub = f"{'Method':{name_w}} | " + "".join(f"{c:>8}" for c in cols) + " | " + \
        "".join(f"{c:>8}" for c in cols) + " | " + f"{'rsum':>7}"
    lines = [title, "=" * len(sub), header, sub, "-" * len(sub)]

    def line(name, values, rsum):
        return (f"{name:{name_w}} | " + "".join(format_cell(v) for v in values[:len(ks)])
                + " | " + "".join(format_cell(v) for v in values[len(ks):2 * len(ks)])
                + f" | {format_cell(rsum, 7)}")

    for r in rows:
        m = r["metrics"]
        keys = [f"i2t_r{k}" for k in ks] + [f"t2i_r{k}" for k in ks]
        vals = [m[k] for k in keys]
        lines.append(line(r["name"], vals, m.get("rsum", sum(vals))))
        if "rsum_fold_std" in m:
            lines.append(line(f"  ± std over {m['num_folds']} folds",
                              [m[f"{k}_fold_std"] for k in keys], m["rsum_fold_std"]))
        if r.get("paper"):
            p = list(r["paper"][:2 * len(ks)])
            rsum = None if any(v is None for v in p) else sum(p)
            lines.append(line("  (paper)", p, rsum))
    lines.append("-" * len(sub))
    return "\n".join(lines)
