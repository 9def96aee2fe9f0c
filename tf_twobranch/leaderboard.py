"""The leaderboard of every registered system on one dataset, one test split and one protocol.

`experiments/leaderboard.py` runs the lines below through their experiments'
public entry (`define_flags`, `run`) and hands their results records here.
This module holds what is not an experiment: which rows make the leaderboard
(`lines`: every registered system's `System.leaderboard`, so a system that
registers is compared with no change here), what a row costs (`measure_row`:
parameters, time in training and in evaluation), reusing a finished run
(`finished_run`), the comparability checks (rows are put in one table only
when their protocol and test-split fingerprint agree; grounding cells only
when their phrase fingerprint agrees), mean ± std over seeds, the table, and
the JSON / CSV / PNG files. It defines no flags and imports no experiment.

Every metric comes from the records, i.e. from the one evaluation core
(`tf_twobranch/evaluation/`): retrieval R@K and median rank
(`evaluation/retrieval.py`), phrase localization R@1 at IoU >= 0.5
(`evaluation/phrase_localization.py`), the pointing game
(`evaluation/pointing_game.py`), gathered per record by `evaluation/grounding.py`.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import pathlib
import time
from typing import Iterator, Sequence

import numpy as np

from tf_twobranch import json_files, systems
from tf_twobranch.errors import UserInputError
from tf_twobranch.systems.registry import LeaderboardLine, LeaderboardRun, Ordering, Side
from tf_twobranch.table_runner import slug

RETRIEVAL_KEYS = ("i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "rsum")
GROUNDING_KEYS = ("pointing", "box_r1")
COST_KEYS = ("params", "train_s", "eval_s")
COLUMNS = {"i2t_r1": "I2T R@1", "i2t_r5": "R@5", "i2t_r10": "R@10", "i2t_medr": "medr",
           "t2i_r1": "T2I R@1", "t2i_r5": "R@5", "t2i_r10": "R@10", "t2i_medr": "medr", "rsum": "rsum",
           "pointing": "point %", "box_r1": "box R@1", "params": "params",
           "train_s": "train s", "eval_s": "eval s"}
GROUNDING_RULE = (
    "grounding, one rule for every system that localizes, on the same Flickr30K Entities test phrases "
    "(the visual phrases whose chain has a box: data/phrases.phrase_examples_from_images, Plummer et "
    "al.'s protocol; a grounding cell is put in its column only when its phrase fingerprint is the "
    "table's): 'point %' = pointing game (evaluation/pointing_game.py: a hit when the system's point "
    "lies in a ground-truth box of the phrase), the point being the heat map's maximum (N-pair), the "
    "centre of the top-ranked proposal box (two-branch region-phrase models), the centre of the box of "
    "the image fragment best aligned with the phrase (fragments: each image fragment scored by the max "
    "over the phrase's dependency triplets of v_i.s_j; a phrase without a triplet is a miss, counted); "
    "'box R@1' = the top-ranked box has IoU >= 0.5 with the phrase's box (evaluation/phrase_localization.py), "
    "for the systems that rank boxes (the proposals; the fragment model's 20 image-fragment boxes)")
CHANCE_NAME = "Chance (expected)"
CENTRE_NAME = "Centre of the image (baseline)"
# The sidecar a finished leaderboard run leaves beside its results.json.
MARKER = "leaderboard_row.json"


def lines() -> tuple[LeaderboardLine, ...]:
    """The leaderboard's lines: every registered system's (`System.leaderboard`), by position."""
    return systems.leaderboard_lines()


def line_keys() -> tuple[str, ...]:
    return tuple(line.key for line in lines())


# ---------------------------------------------------------------------------- paper orderings

# Each system declares its paper's orderings and the sibling rows they compare against
# (`System.orderings`, `System.siblings`); every line is also checked against random ranking.
RANDOM_KEY = "random"


def siblings() -> dict[str, LeaderboardRun]:
    """The sibling rows the registered systems' orderings need beside the lines (same protocol and
    split; the N-pair rows grounded on the same phrases), by key."""
    return systems.leaderboard_siblings()


def orderings() -> tuple[Ordering, ...]:
    """The registered systems' paper orderings, then "every line beats random ranking"."""
    beats_random = tuple(Ordering(f"{key} beats random ranking", "every paper", Side(key, key),
                                  Side(RANDOM_KEY, RANDOM_KEY))
                         for key in line_keys() if key != RANDOM_KEY)
    return systems.leaderboard_orderings() + beats_random


ONE_SEED_VERDICT = "one seed: not tested (the rule needs >= 2 seeds)"
ORDERING_RULE = ("an ordering holds beyond the seed spread when the paired difference (better - worse, "
                 "same seed) is positive on every seed and its mean exceeds twice its standard deviation "
                 "over seeds; with one seed it is not tested")


def siblings_needed(systems: Sequence[str]) -> list[str]:
    """The sibling rows of the orderings whose leaderboard systems are all in `systems`."""
    keys, rows = set(systems), siblings()
    needed = []
    for o in orderings():
        sides = (o.better.source, o.worse.source)
        if all(s in keys or s in rows for s in sides) and any(s in keys for s in sides):
            needed += [s for s in sides if s in rows and s not in needed]
    return needed


def _side_record(side: Side, entry: dict) -> dict | None:
    """The record of one seed's `entry` that holds `side`'s metric."""
    system = next((s for s in lines() if s.key == side.source), None)
    if side.metric in ("pointing", "box_r1") and system is not None:
        source = system.grounding_source(entry) or {}
    else:
        source = entry.get("retrieval") or {}
    return source.get("record")


def side_value(side: Side, entry: dict) -> tuple[float | None, tuple | None]:
    """(value, what it was measured on) of `side` in one seed's entry; (None, None) if absent.
    Retrieval values are measured on (protocol, test split), grounding values on a phrase set."""
    record = _side_record(side, entry)
    if not record:
        return None, None
    if side.metric in ("pointing", "box_r1"):
        cells = grounding_cells(record)
        if side.metric not in cells:
            return None, None
        return cells[side.metric], ("phrases", cells["phrase_fingerprint"], cells["num_phrases"])
    if side.metric == "stage1_rsum":
        stages = record.get("stages") or []
        value = ((stages[0].get("metrics") or {}).get("rsum") if len(stages) > 1 else None)
    else:
        value = (record.get("metrics") or {}).get(side.metric)
    return (None, None) if value is None else (float(value), ("split",) + split_identity(record))


def check_orderings(entries: dict[str, list[dict]], checked: Sequence[Ordering] | None = None) -> list[dict]:
    """Every ordering with both sides present: the paired differences per seed and the verdict.

    `entries[key]` is one entry per seed (index = seed) for a system or a sibling key, as in
    `assemble`. Sides measured on different splits, protocols or phrase sets are not compared."""
    out = []
    for o in orderings() if checked is None else checked:
        better_runs, worse_runs = entries.get(o.better.source), entries.get(o.worse.source)
        if not better_runs or not worse_runs:
            continue
        diffs, notes = [], []
        for seed, (b, w) in enumerate(zip(better_runs, worse_runs)):
            (bv, bon), (wv, won) = side_value(o.better, b), side_value(o.worse, w)
            if bv is None or wv is None:
                notes.append(f"seed {seed}: {'better' if bv is None else 'worse'} side missing")
            elif bon != won:
                notes.append(f"seed {seed}: measured on different {bon[0]}s ({bon[1:]} vs {won[1:]})")
            else:
                diffs.append({"seed": seed, "better": bv, "worse": wv, "difference": bv - wv})
        values = [d["difference"] for d in diffs]
        summary = summarize(values)
        if summary is None:
            verdict = "not measured (" + "; ".join(notes) + ")"
        elif summary["n"] == 1:
            # The rule needs the spread over seeds: one seed can neither confirm nor refute it.
            verdict = ONE_SEED_VERDICT
        elif all(v > 0 for v in values) and summary["mean"] > 2 * summary["std"]:
            verdict = "yes"
        elif all(v > 0 for v in values):
            verdict = "no: holds on every seed, within the spread"
        elif all(v < 0 for v in values):
            verdict = "no: reversed on every seed"
        else:
            verdict = "no: the sign changes with the seed"
        out.append({"claim": o.claim, "paper": o.paper, "better": o.better.label, "worse": o.worse.label,
                    "metric": o.better.metric if o.better.metric == o.worse.metric
                    else f"{o.better.metric} vs {o.worse.metric}",
                    "seeds": diffs, "difference": summary, "beyond_spread": verdict == "yes",
                    "verdict": verdict, "notes": notes})
    return out


def format_orderings(rows: Sequence[dict]) -> str:
    """The orderings table: paired differences per seed, mean ± std, verdict."""
    if not rows:
        return ""
    lines = ["Paper orderings on this data (" + ORDERING_RULE + "):"]
    for r in rows:
        per_seed = ", ".join(f"{d['difference']:+.1f}" for d in r["seeds"]) or "-"
        s = r["difference"]
        mean = "" if s is None else f"; mean {s['mean']:+.1f} \u00b1 {s['std']:.1f}"
        lines.append(f"  {r['claim']} [{r['paper']}; {r['metric']}: {r['better']} - {r['worse']}]: "
                     f"{per_seed}{mean} -> beyond the seed spread? {r['verdict']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- cost

# A run's seconds on the embedded data (features included: they are computed once, for the first
# seed, since every seed shares them) on the machine of BUILD_NOTES.md's leaderboard runs (the
# shared 2-core Xeon, loaded, so upper bounds; the dual path: its 100 + 20 epoch profile, 2,238 s on
# Zen 4 beside two other jobs): each system declares its runs' (`LeaderboardRun.reference_seconds`),
# this for a run that does not. Scaled by this machine's matmul probe as the main job's estimate is
# (`speed.estimate_on_this_machine`).
DEFAULT_RUN_SECONDS = 200
ESTIMATE_SPREAD = 1.3   # `speed.ESTIMATE_SPREAD` (speed imports TensorFlow; this module does not)


def estimate_seconds(runs: Sequence[LeaderboardRun]) -> float:
    """The expected wall time of training `runs` on this machine (embedded data)."""
    from tf_twobranch.speed import estimate_on_this_machine

    return estimate_on_this_machine(sum(run.reference_seconds or DEFAULT_RUN_SECONDS for run in runs))



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


@contextlib.contextmanager
def measure_row() -> Iterator[RowCost]:
    """Measures a row run inside the block through the package's one trainer (`trainer.train`)
    and the CCA baseline's `fit`, the two ways a system is trained (`training.fit_timing`).

    Training seconds are the time inside those calls; evaluation seconds the time from the end
    of each call to the next one or to the end of the block (scoring the test split, the
    grounding, writing the record); data loading and cached features before the first call
    count in neither. Parameters: every weight of the trained model (frozen backbones included).
    """
    from tf_twobranch.training import fit_timing

    cost = RowCost()

    class Listener:
        @staticmethod
        def started(start):
            cost.close(start)

        @staticmethod
        def finished(start, end, params):
            cost.train_s = (cost.train_s or 0.0) + end - start
            cost._last_end = end
            cost.params = max(cost.params or 0, params or 0)

    try:
        with fit_timing.listening(Listener):
            yield cost
    finally:
        cost.close(time.perf_counter())


# ---------------------------------------------------------------------------- runs


def run_arguments(run: LeaderboardRun, *, dataset_dir: str, seed: int, run_dir: pathlib.Path,
                  extra: Sequence[str] = ()) -> list[str]:
    """The flags added to a run's flagfile: the leaderboard's, the dataset, the seed, the run folder
    and the caller's `extra` (last, so they win)."""
    args = [*run.flags, f"--seed={seed}", f"--run_dir={run_dir}"]
    if dataset_dir:
        args.append(f"--dataset_dir={dataset_dir}")
    return [*args, *extra]


def finished_run(run_dir: pathlib.Path, arguments: Sequence[str], *,
                 needs_grounding: bool = False) -> dict | None:
    """The record and cost of a finished leaderboard run made with these arguments, else None.

    `needs_grounding`: the run is where its system's grounding comes from, so a record without a
    grounding summary (`evaluation.grounding`, written since issue 24 item 4) or the reason it
    could not be computed is not reused."""
    marker, results = run_dir / MARKER, run_dir / "results.json"
    if not (marker.exists() and results.exists()):
        return None
    saved = json_files.read_json_object(marker, "leaderboard run marker")
    record = json_files.read_json_object(results, "run results")
    if saved.get("arguments") != list(arguments) or "test_split_fingerprint" not in record:
        return None
    if needs_grounding and not ("grounding" in record or record.get("pointing_not_computed")):
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
    """The grounding cells of a record's grounding summary (`evaluation.grounding`): the pointing
    accuracy, box R@1 at IoU 0.5 (systems that rank boxes), the phrase fingerprint and the number
    of phrases; {} when the record has none."""
    grounding = record.get("grounding") or {}
    if "phrase_fingerprint" not in grounding:
        return {}
    out = {"pointing": float(grounding["pointing_accuracy"]), "phrase_fingerprint": grounding["phrase_fingerprint"],
           "num_phrases": int(grounding["num_phrases"]), "rule": grounding.get("rule")}
    if grounding.get("box_r1") is not None:
        out["box_r1"] = float(grounding["box_r1"])
    return out


def grounding_reason(record: dict) -> str:
    """Why a localizing system's record has no grounding cells ('' when it has them)."""
    grounding = record.get("grounding") or {}
    if "phrase_fingerprint" in grounding:
        return ""
    return (grounding.get("not_computed") or record.get("pointing_not_computed")
            or "the record has no grounding summary (written before issue 24 item 4: run it again)")


def chance_cells(record: dict) -> dict:
    """The record's chance level (random embeddings on the same split and protocol)."""
    chance = record.get("random_baseline") or (record.get("metrics") or {}).get("random_baseline") or {}
    return {k: float(chance[k]) for k in RETRIEVAL_KEYS if k in chance}


def expected_chance(split: dict) -> dict:
    """The expected cells of random ranking on the table's split (`evaluation.chance`: analytic,
    not one draw), its captions spread as evenly as the totals allow; {} when the split is unknown."""
    from tf_twobranch.evaluation import chance

    if not split.get("num_test_images") or not split.get("num_test_captions") or not split.get("protocol"):
        return {}
    counts = chance.even_caption_counts(int(split["num_test_images"]), int(split["num_test_captions"]))
    return chance.expected_random_metrics(counts, split["protocol"])


def grounding_baselines(queries: Sequence, phrases: dict, proposals: dict | None = None,
                        max_proposals: int | None = None) -> dict:
    """The grounding baselines on the table's phrases: the expected pointing accuracy of a random
    pixel, the accuracy of the image's centre, and (with the proposals the box rankers rank) the
    expected box R@1 of a random one of each image's first `max_proposals` proposals. Computed only
    when `queries` are the table's phrases (same phrase fingerprint), else {"not_computed": why}."""
    from tf_twobranch.data.phrases import phrase_fingerprint
    from tf_twobranch.evaluation import chance

    if not phrases.get("phrase_fingerprint"):
        return {"not_computed": "no grounding cell in the table"}
    fingerprint = phrase_fingerprint(queries)
    if fingerprint != phrases["phrase_fingerprint"]:
        return {"not_computed": f"the dataset's test phrases ({fingerprint}, {len(queries)}) are not the "
                                f"table's ({phrases['phrase_fingerprint']}, {phrases.get('num_phrases')})"}
    out = {"random_point": chance.random_point_accuracy(queries), "centre_point": chance.centre_point_accuracy(queries),
           "num_phrases": len(queries)}
    if proposals is not None:
        out["random_box_r1"] = chance.random_box_r1(queries, proposals, max_proposals)
        out["max_proposals"] = max_proposals
    return out


def summarize(values: Sequence[float | None]) -> dict | None:
    """Mean and sample standard deviation (ddof 1; 0 for one seed) of the seeds' values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
            "n": len(vals), "values": vals}


def split_identity(record: dict) -> tuple:
    return (record.get("protocol"), record.get("test_split_fingerprint"))


def _grounding_of(system: LeaderboardLine, runs: list[dict]) -> tuple[list[dict], list[str]]:
    """The grounding cells of a system's seeds (records with a grounding summary) and the reasons
    of those without one (a failed run, a dataset without Entities, ...)."""
    cells, reasons = [], []
    for entry in runs:
        source = system.grounding_source(entry)
        if source is None:
            continue
        if "error" in source:
            reasons.append(source["error"])
        elif "record" in source:
            found = grounding_cells(source["record"])
            if found:
                cells.append(found)
            else:
                reasons.append(grounding_reason(source["record"]))
    return cells, reasons


def assemble(system_runs: dict[str, list[dict]]) -> dict:
    """Aggregates the seeds' runs of every system into leaderboard rows.

    `system_runs[key]`: one entry per seed, each {"retrieval": run or {"error": reason},
    "grounding": run, {"error": reason} or None}, a run being {"record", "cost", "reused"}.
    Returns {"rows": [...], "split": {...}, "apart": [...], "phrases": {...},
    "grounding_apart": [...]}: the rows measured on the reference (protocol, test split) — the
    one most systems share — and, apart, every row measured otherwise (never put in the table);
    likewise the grounding cells are over the reference phrases (the phrase fingerprint most
    grounding records share, `data.phrases.phrase_fingerprint`) and a system grounded on other
    phrases is listed apart in ``grounding_apart``, its grounding cells left empty.
    """
    identities: dict[tuple, int] = {}
    phrase_sets: dict[tuple, int] = {}
    for system in lines():
        for entry in system_runs.get(system.key, []):
            rec = (entry.get("retrieval") or {}).get("record")
            if rec:
                identities[split_identity(rec)] = identities.get(split_identity(rec), 0) + 1
        for c in _grounding_of(system, system_runs.get(system.key, []))[0]:
            phrases = (c["phrase_fingerprint"], c["num_phrases"])
            phrase_sets[phrases] = phrase_sets.get(phrases, 0) + 1
    reference = max(identities, key=identities.get) if identities else (None, None)
    reference_phrases = max(phrase_sets, key=phrase_sets.get) if phrase_sets else (None, None)
    rows, apart, grounding_apart = [], [], []
    for system in lines():
        runs = system_runs.get(system.key)
        if runs is None:
            continue
        # A system is missing when no seed has a retrieval record (e.g. --reuse_only before it ran),
        # reused when every run that gave a record was a finished run reused.
        ran = [run for e in runs for run in (e.get("retrieval"), e.get("grounding")) if run and "record" in run]
        missing = not any("record" in (e.get("retrieval") or {}) for e in runs)
        row = {"key": system.key, "name": system.name, "family": system.family,
               "flagfile": system.retrieval.flagfile, "seeds": len(runs), "cells": {}, "notes": [],
               "missing": missing, "reused": not missing and all(run.get("reused") is True for run in ran)}
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
        g_cells, g_reasons = _grounding_of(system, runs)
        other = [c for c in g_cells if (c["phrase_fingerprint"], c["num_phrases"]) != reference_phrases]
        if other:
            grounding_apart.append({"key": system.key, "name": system.name,
                                    "phrase_fingerprint": other[0]["phrase_fingerprint"],
                                    "num_phrases": other[0]["num_phrases"], "pointing": other[0]["pointing"],
                                    "box_r1": other[0].get("box_r1")})
            g_reasons.insert(0, f"grounded on other phrases ({other[0]['phrase_fingerprint']}, "
                                f"{other[0]['num_phrases']} phrases): listed apart")
            g_cells = []
        for key in GROUNDING_KEYS:
            row["cells"][key] = summarize([c.get(key) for c in g_cells])
        if not system.localizes:
            row["grounding_unavailable"] = system.no_grounding
        elif g_reasons:
            row["grounding_unavailable"] = g_reasons[0]
        elif not g_cells:
            row["grounding_unavailable"] = "no grounding run"
        grounding_runs = [e.get("grounding") for e in runs]
        g_costs = [g["cost"] for g in grounding_runs if g and "cost" in g]
        row["cells"]["params"] = summarize([c["params"] for c in costs])
        row["cells"]["train_s"] = summarize([c["train_s"] for c in costs])
        row["cells"]["eval_s"] = summarize([c["eval_s"] for c in costs])
        if g_costs:
            row["grounding_cost"] = {k: summarize([c[k] for c in g_costs]) for k in COST_KEYS}
        row["protocol"], row["test_split_fingerprint"] = split_identity(records[0]) if records else (None, None)
        row["grounding_fingerprint"] = g_cells[0]["phrase_fingerprint"] if g_cells else None
        row["grounding_phrases"] = g_cells[0]["num_phrases"] if g_cells else None
        row["grounding_rule"] = g_cells[0]["rule"] if g_cells else None
        rows.append(row)
    first = next((e["retrieval"]["record"] for runs in system_runs.values() for e in runs
                  if "record" in (e.get("retrieval") or {}) and split_identity(e["retrieval"]["record"]) == reference),
                 {})
    split = {"protocol": reference[0], "test_split_fingerprint": reference[1],
             "num_test_images": first.get("num_test_images"), "num_test_captions": first.get("num_test_captions")}
    phrases = {"phrase_fingerprint": reference_phrases[0], "num_phrases": reference_phrases[1]}
    return {"rows": rows, "split": split, "apart": apart, "phrases": phrases, "grounding_apart": grounding_apart,
            "chance": expected_chance(split)}


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
    table = [[r["name"] + (" (missing)" if r.get("missing") else " (reused)" if r["reused"] else "")]
             + [_cell(r["cells"].get(k), k) for k in keys] for r in board["rows"]]
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
        if r["cells"].get("params") is None and not r.get("unavailable"):
            mark(i, ["params", "train_s", "eval_s"], f"{r['name']}: nothing is trained")
    chance = board.get("chance") or {}
    baselines = board.get("grounding_baselines") or {}
    if chance or "random_point" in baselines:
        box = baselines.get("random_box_r1")
        table.append([CHANCE_NAME] + [f"{chance[k]:.{0 if k.endswith('medr') else 1}f}" if k in chance else ""
                                      for k in RETRIEVAL_KEYS]
                     + [f"{baselines['random_point']:.1f}" if "random_point" in baselines else "",
                        "" if box is None else f"{box:.1f}"] + [""] * len(COST_KEYS))
    if "centre_point" in baselines:
        table.append([CENTRE_NAME] + [""] * len(RETRIEVAL_KEYS) + [f"{baselines['centre_point']:.1f}", ""]
                     + [""] * len(COST_KEYS))
    header = ["System"] + [COLUMNS[k] for k in keys]
    widths = [max(len(str(row[c])) for row in [header, *table]) for c in range(len(header))]
    line = lambda cells: " | ".join(f"{c:<{widths[0]}}" if j == 0 else f"{c:>{widths[j]}}"  # noqa: E731
                                    for j, c in enumerate(cells))
    title = (f"Leaderboard on {dataset}: test split {split['test_split_fingerprint']} "
             f"({split['num_test_images']} images, {split['num_test_captions']} captions), protocol "
             f"{split['protocol']}; mean ± std over seeds {list(seeds)}")
    systems = len(board["rows"])
    out = [title, "=" * len(line(header)), line(header), "-" * len(line(header)), *map(line, table[:systems]),
           "-" * len(line(header)), *map(line, table[systems:])]
    if chance:
        out.append(f"{CHANCE_NAME}: retrieval cells = the expected value of random ranking on this split and "
                   f"protocol (evaluation/chance.py, analytic, not one draw)" +
                   (f"; point % = the expected accuracy of a random pixel, box R@1 = of a random one of each "
                    f"image's first {baselines.get('max_proposals') or 'all'} proposals"
                    if "random_point" in baselines else ""))
    if "centre_point" in baselines:
        out.append(f"{CENTRE_NAME}: the pointing game of the image's centre pixel on the same phrases")
    elif baselines.get("not_computed"):
        out.append(f"grounding baselines not computed: {baselines['not_computed']}")
    phrases = board.get("phrases") or {}
    out.append(GROUNDING_RULE + ".")
    out.append(f"grounding phrases: {phrases.get('num_phrases')} (phrase fingerprint "
               f"{phrases.get('phrase_fingerprint')}), the same for every grounding cell of the table")
    out.append("cost: params = every weight of the trained model (frozen CNNs included; CCA: its "
               "projections and means); train s = seconds inside training calls; eval s = seconds from "
               "the end of training to the end of the row (scoring the test split, writing the record); "
               "grounding runs' cost is in the JSON. Retrieval and cost cells are the retrieval run's.")
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    for a in board["apart"]:
        out.append(f"NOT COMPARABLE (listed apart, not in the table): {a['name']}: protocol {a['protocol']}, "
                   f"split {a['test_split_fingerprint']}, rsum {a['metrics'].get('rsum', float('nan')):.1f}")
    for a in board.get("grounding_apart", []):
        box = "" if a.get("box_r1") is None else f", box R@1 {a['box_r1']:.1f}"
        out.append(f"NOT COMPARABLE (grounding on other phrases, not in the table): {a['name']}: "
                   f"{a['num_phrases']} phrases ({a['phrase_fingerprint']}), point % {a['pointing']:.1f}{box}")
    out += list(footer)
    return "\n".join(out)


def run_counts(board: dict) -> str:
    """How many of the table's systems were reused, trained and missing (never ran)."""
    rows = board["rows"]
    missing = sum(bool(r.get("missing")) for r in rows)
    reused = sum(bool(r["reused"]) for r in rows)
    text = f"{reused} of {len(rows)} systems reused"
    if len(rows) - reused - missing:
        text += f", {len(rows) - reused - missing} trained"
    return text + (f", {missing} missing (never ran)" if missing else "")


def write_csv(path: pathlib.Path, board: dict) -> pathlib.Path:
    """One line per system: mean and std of every cell, protocol, fingerprints, reasons."""
    keys = [*RETRIEVAL_KEYS, *GROUNDING_KEYS, *COST_KEYS]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["key", "name", "seeds", "protocol", "test_split_fingerprint", "grounding_fingerprint",
                     "grounding_phrases",
                     *(f"{k}_{s}" for k in keys for s in ("mean", "std")), "unavailable",
                     "grounding_unavailable", "reused"])
    for r in board["rows"]:
        cells = [("" if r["cells"].get(k) is None else f"{r['cells'][k][s]:.4g}") for k in keys
                 for s in ("mean", "std")]
        writer.writerow([r["key"], r["name"], r["seeds"], r["protocol"], r["test_split_fingerprint"],
                         r["grounding_fingerprint"], r["grounding_phrases"], *cells, r.get("unavailable", ""),
                         r.get("grounding_unavailable", ""), r["reused"]])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    tmp.write_text(buffer.getvalue(), encoding="utf-8")
    tmp.replace(path)
    return path


def write_figure(path: pathlib.Path, board: dict, title: str) -> pathlib.Path:
    """rsum and grounding accuracy per system: the seeds' standard deviation as error bars (only
    with >= 2 seeds), a missing cell hatched and marked "n/a" (never an empty bar that reads as 0),
    chance and the grounding baselines as dashed lines, axis labels, legends beside the axes."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = board["rows"]
    names = [r["key"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))

    def bars(ax, key, offset, width, label, colour, top):
        cells = [r["cells"].get(key) for r in rows]
        x = np.arange(len(rows)) + offset
        present = [i for i, c in enumerate(cells) if c is not None]
        if present:
            spread = any(cells[i]["n"] > 1 for i in present)
            ax.bar(x[present], [cells[i]["mean"] for i in present], width, color=colour, label=label,
                   yerr=[cells[i]["std"] for i in present] if spread else None, capsize=3)
        missing = [i for i, c in enumerate(cells) if c is None]
        if missing:
            ax.bar(x[missing], [0.03 * top] * len(missing), width, color="none", edgecolor=colour,
                   hatch="///", label=f"{label}: n/a")
            for i in missing:
                ax.text(x[i], 0.04 * top, "n/a", ha="center", va="bottom", fontsize=7, color="dimgrey",
                        rotation=90, gid="not_available")
        ax.set_ylim(0, top)

    chance = (board.get("chance") or {}).get("rsum")
    rsums = [c["mean"] + c["std"] for c in (r["cells"].get("rsum") for r in rows) if c is not None]
    bars(axes[0], "rsum", 0.0, 0.6, "rsum", "tab:blue", 1.15 * max(rsums + [chance or 0.0, 10.0]))
    if chance is not None:
        axes[0].axhline(chance, color="grey", linestyle="--", label=f"chance (expected) {chance:.1f}")
    axes[0].set_title("retrieval rsum (R@1+5+10 both ways)")
    axes[0].set_ylabel("rsum (sum of six recalls, %)")
    bars(axes[1], "pointing", -0.2, 0.4, "pointing game %", "tab:orange", 100.0)
    bars(axes[1], "box_r1", 0.2, 0.4, "box R@1 (IoU ≥ 0.5) %", "tab:green", 100.0)
    baselines = board.get("grounding_baselines") or {}
    for key, label, style in (("random_point", "random point", ":"), ("centre_point", "image centre", "--"),
                              ("random_box_r1", "random proposal (box R@1)", "-.")):
        if baselines.get(key) is not None:
            axes[1].axhline(baselines[key], color="grey", linestyle=style, label=f"{label} {baselines[key]:.1f}")
    axes[1].set_title("grounding on the same Entities test phrases")
    axes[1].set_ylabel("accuracy (%)")
    seeds = max([(r["cells"].get("rsum") or {}).get("n", 0) for r in rows] + [0])
    for ax in axes:
        ax.set_xticks(np.arange(len(rows)), names, rotation=30, ha="right")
        ax.set_xlabel("system" + (f" (error bars: std over {seeds} seeds)" if seeds > 1 else " (one seed)"))
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
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


# ---------------------------------------------------------------------------- an invocation

def dataset_tag(dataset_dir: str) -> str:
    """The run-folder name of a dataset: 'embedded', or the folder's name and a hash of its path."""
    if not dataset_dir:
        return "embedded"
    path = str(pathlib.Path(dataset_dir).resolve())
    return f"{slug(pathlib.Path(path).name)}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def _max_proposals(system_runs: dict) -> int | None:
    """How many proposals per image the box rankers' region runs ranked (their recorded flags)."""
    for runs in system_runs.values():
        for entry in runs:
            record = (entry.get("grounding") or {}).get("record") or {}
            if (record.get("flags") or {}).get("max_proposals"):
                return int(record["flags"]["max_proposals"])
    return None


def dataset_grounding_baselines(dataset_dir: str, board: dict, system_runs: dict) -> dict:
    """The random-point, centre and random-proposal baselines on the dataset's test phrases, when
    they are the table's (`grounding_baselines` checks the phrase fingerprint)."""
    if not board["phrases"].get("phrase_fingerprint"):
        return {"not_computed": "no grounding cell in the table"}
    from tf_twobranch.data.formats.proposals import read_proposals
    from tf_twobranch.data.from_flags import dataset_folder
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.evaluation.pointing_game import pointing_queries

    try:
        layout = resolve_dataset(dataset_folder(dataset_dir or None))
        layout.require("entities", purpose="the grounding baselines")
        ids = layout.split_ids("test")
        queries = pointing_queries(layout.entities_dir, ids)
        proposals = read_proposals(layout.proposals, ids) if layout.has("proposals") else None
    except UserInputError as err:
        return {"not_computed": str(err)}
    return grounding_baselines(queries, board["phrases"], proposals, _max_proposals(system_runs))


def planned_runs(systems_: Sequence[str], seeds: int, base: pathlib.Path, *, grounding: bool = True,
                 orderings: bool = True) -> list[tuple]:
    """(line or sibling key, run, seed, run folder) of every run an invocation for the lines
    `systems_` needs (their grounding runs with `grounding`, the ordering siblings with `orderings`)."""
    planned = []
    for line in lines():
        if line.key in systems_:
            for seed in range(seeds):
                folder = base / f"seed{seed}" / line.key
                planned.append((line.key, line.retrieval, seed, folder / "retrieval"))
                if line.grounding and grounding:
                    planned.append((line.key, line.grounding, seed, folder / "grounding"))
    rows = siblings()
    for key in (siblings_needed(systems_) if orderings else []):
        planned += [(key, rows[key], seed, base / f"seed{seed}" / "siblings" / key) for seed in range(seeds)]
    return planned


def estimate_message(planned: int, to_train: Sequence[LeaderboardRun], dataset_dir: str) -> str:
    """The line printed up front, like the main job's: the runs to train, the reused ones, the time."""
    reused = planned - len(to_train)
    if not to_train:
        return f"Estimated time: seconds ({planned} runs, every one reused or skipped)."
    if dataset_dir:
        return f"Estimated time: depends on your dataset's size ({len(to_train)} runs to train, {reused} reused)."
    low = estimate_seconds(to_train) / 60
    return (f"Estimated time on this machine: {low:.0f}–{low * ESTIMATE_SPREAD:.0f} min for {len(to_train)} runs "
            f"to train ({reused} reused; the first run of a seed also computes its features).")


def finish(system_runs: dict, sibling_runs: dict, *, dataset_dir: str, seeds: Sequence[int], base: pathlib.Path,
           out_dir: pathlib.Path, start: float, orderings: bool, meta: dict) -> dict:
    """The leaderboard of the runs (`assemble`, the grounding baselines, the orderings), its table and
    its files in `out_dir`: {"board", "table", "files"}."""
    board = assemble(system_runs)
    board["grounding_baselines"] = dataset_grounding_baselines(dataset_dir, board, system_runs)
    board["orderings"] = check_orderings({**system_runs, **sibling_runs}) if orderings else []
    dataset = dataset_dir or "the embedded data"
    footer = [f"runs: {base}; wall time of this invocation {time.time() - start:.0f} s ({run_counts(board)})"]
    table = format_table(board, dataset=dataset, seeds=seeds, footer=footer)
    if board["orderings"]:
        table += "\n\n" + format_orderings(board["orderings"])
    meta = {"dataset": dataset, "seeds": list(seeds), "seconds": time.time() - start, **meta}
    return {"board": board, "table": table, "files": write_outputs(out_dir, board, table, meta)}


def experiment_of(run: LeaderboardRun) -> str:
    """The module (``define_flags``, ``run``) of the experiment that trains `run`: its task's."""
    return systems.tasks()[run.task].experiment


def row_flags(values, system_key: str, experiment: str, defined) -> list[str]:
    """The ``--row_flag=TARGET:--flag=value`` flags that go to a run of line `system_key` whose experiment
    (its module's last name) is `experiment` and defines the flags `defined`."""
    out = []
    for value in values:
        target, sep, flag = value.partition(":")
        if not sep or not flag.startswith("--"):
            raise UserInputError(f"--row_flag={value!r}: expected TARGET:--flag=value")
        experiments = {experiment_of(r).rsplit(".", 1)[-1] for s in lines()
                       for r in (s.retrieval, s.grounding) if r}
        if target not in ("*", experiment, *line_keys(), *experiments):
            raise UserInputError(f"--row_flag={value!r}: unknown target {target!r} (a system key, an "
                                 "experiment name or '*')")
        name = flag[2:].split("=", 1)[0]
        if target in (system_key, experiment) or (target == "*" and (name in defined or
                                                                    name.removeprefix("no") in defined)):
            out.append(flag)
    return out
