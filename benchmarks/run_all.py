"""One command, one table: every benchmark of the package at paper sizes.

Run from the repository root:

    python -m benchmarks.run_all [--quick] [--out_json benchmarks/results/run_all.json]
                                 [--out_md benchmarks/results/run_all.md]

Prints one table (and writes it as markdown, plus every figure as JSON):

* float32 matmul peak of this machine (`common.measure_matmul_gflops`);
* training throughput at paper sizes (examples/s, s/step; float32 and
  mixed_bfloat16 where the package offers it) of the embedding network, the
  similarity network, the LSTM text branch (`bench_embedding`), the
  phrase-localization embedding network (`bench_phrase_localization`), and
  the dual-path CNN's Stage I and Stage II steps and tower forwards
  (`bench_dual_path`); the embedding step also as GFLOP/s and fraction of
  the matmul peak;
* evaluation time and peak memory of `tf_twobranch.evaluation.retrieval` at
  1K x 5K, 5K x 25K and 25K x 125K (images x captions, 512-d);
* tf.data pipeline throughput (batches/s) against the consuming step's
  steps/s: `image_sentence_batches` + `attach_features` (paper-size
  features), Algorithm 1's phrase batches, the dual-path
  `train_dataset` on the embedded dataset's real JPEGs at 224 crops, and
  the deep fragment and N-pair streams over memory-mapped float16 rows
  against their paper-size steps, fixed and fed (`bench_input_pipelines.fed_child`).

`--quick` (about six minutes): fewer repetitions, float32 only except for
the embedding network, no 25K x 125K gallery.
The full run takes ~16-21 minutes on 2 cores (the fragment and N-pair input
rows ~1 minute of it). The machine may be shared: the
load average is printed at start, at end and next to every figure in the JSON.
Every measurement runs in a fresh spawn subprocess (`benchmarks.common`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from benchmarks import bench_dual_path, bench_embedding, bench_phrase_localization, common

EVAL_SIZES = (1000, 5000, 25000)


def _log(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message} ...", file=sys.stderr, flush=True)


def measure_two_branch(quick: bool, sizes: dict = bench_embedding.PAPER_SIZES,
                       subprocess: bool = True, steps: int | None = None,
                       warmup: int | None = None, kinds=bench_embedding.MODEL_KINDS,
                       precisions=bench_dual_path.PRECISIONS) -> list[dict]:
    """Train-step rows of the embedding / similarity networks and the LSTM branch."""
    run = common.run_in_subprocess if subprocess else (lambda fn, *a, **k: fn(*a, **k))
    steps = steps or (4 if quick else 10)
    warmup = warmup or (2 if quick else 3)
    rows = []
    for kind in kinds:
        for precision in precisions:
            if quick and precision != "float32" and kind != "embedding":
                continue
            _log(f"train step: {kind}, {precision}")
            r = run(bench_embedding._train_child, False, "fixed", "package", steps, warmup,
                    None, precision, kind, sizes)
            r["examples_per_batch"] = bench_embedding.examples_per_batch(kind, sizes)
            rows.append(r)
    return rows


def measure_phrase_localization(quick: bool, num_images: int | None = None,
                                subprocess: bool = True) -> dict:
    """Phrase-localization embedding network: pipeline alone, step on a fixed batch, step fed.

    A smaller synthetic training split than bench_phrase_localization's
    (the batch — 100 phrases with their images' 200 proposals each — has
    the same size; only the pool it is drawn from is smaller).
    """
    run = common.run_in_subprocess if subprocess else (lambda fn, *a, **k: fn(*a, **k))
    num_images = num_images or (150 if quick else 400)
    _log(f"phrase localization: pipeline + step ({num_images} synthetic images)")
    return run(bench_phrase_localization._pipeline_child, "embedding", num_images, 7.0, 200,
               4096, 10 if quick else 30, 3 if quick else 6, 2, 20)


FED_SYSTEMS = ("fragments", "npair")


def measure_fed_pipeline(system: str, quick: bool, subprocess: bool = True, images: int | None = None,
                         work_dir: str | None = None) -> dict:
    """Deep fragment / N-pair training stream against its paper-size step (`bench_input_pipelines.fed_child`).

    Random float16 memory-mapped rows of the real sizes; fewer images than Flickr30K (a batch
    reads the same bytes whatever the number of images: only the file is smaller), read from the
    page cache. `work_dir`: where its own temporary folder goes (default: the system's).
    """
    run = common.run_in_subprocess if subprocess else (lambda fn, *a, **k: fn(*a, **k))
    images = images or (1000 if quick else 3000)
    work = tempfile.mkdtemp(prefix=f"tf_twobranch_run_all_{system}_", dir=work_dir)
    try:
        return run(_fed_child, system, images, work, 20 if quick else 40, 3 if quick else 6, 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fed_child(*args):
    # Imported here: bench_input_pipelines imports TensorFlow, which this parent never does.
    from benchmarks import bench_input_pipelines
    return bench_input_pipelines.fed_child(*args)


def measure_evaluation(quick: bool) -> list[dict]:
    sizes = EVAL_SIZES[:2] if quick else EVAL_SIZES
    out = []
    for n in sizes:
        _log(f"retrieval_metrics {n:,} x {5 * n:,}")
        out.append(bench_embedding.measure_evaluation(n, repeats=2 if (quick or n > 5000) else 3))
    return out


# --- the table -----------------------------------------------------------------------------

HEADERS = ["group", "benchmark", "precision", "s / call", "throughput", "compared with",
           "peak memory", "load"]


def _f(x: float, digits: int = 3) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}g}"


def build_rows(report: dict) -> tuple[list[list[str]], list[str]]:
    """The table's rows and its footnotes from a run_all report."""
    rows, notes = [], []
    peak, source = matmul_peak(report)
    rows.append(["peak", "float32 tf.matmul peak of this run", "float32", "",
                 f"{peak:.0f} GFLOP/s", source, "", _load(report["matmul"])])
    flops = bench_embedding.step_flops()["total"]
    names = {"embedding": "embedding network, 500 img x 2 sent, 4096/6000-2048-512",
             "similarity": "similarity network, 1000 pairs, 4096/6000-2048-512-(512,256,1)",
             "lstm": "LSTM text branch, 500 img x 2 sent, vocab 20,074, emb 256, LSTM 512"}
    for r in report["two_branch"]:
        s = r["step_seconds_median"]
        extra = ""
        if r["kind"] == "embedding":
            gflops = flops / s / 1e9
            extra = (f"{gflops:.0f} GFLOP/s = {100 * gflops / peak:.0f}% of the float32 peak "
                     f"({100 * gflops / r['matmul_gflops_same_process']:.0f}% of a same-process "
                     f"float32 2048² matmul)")
        rows.append(["train", names[r["kind"]], r["precision"], f"{s:.3f} s/step",
                     f"{_f(r['examples_per_second'])} pairs/s", extra, "", _load(r)])
    pl = report.get("phrase_localization")
    if pl:
        s = pl["step_fixed"]["seconds_median"]
        rows.append(["train", f"phrase-loc. embedding network, {pl['phrase_rows']} phrases x "
                     f"{pl['region_rows']:,} regions, 4096/6000-1024-512", "float32",
                     f"{s:.3f} s/step", f"{_f(pl['phrase_rows'] / s)} phrases/s", "", "", _load(pl)])
    dp = report.get("dual_path")
    if dp:
        for r in dp["steps"]:
            stage = "I (ResNet-50 frozen)" if r["stage"] == 1 else "II (all trainable)"
            rows.append(["train", f"dual-path Stage {stage}, batch 32, 224², 29,783 classes",
                         r["precision"], f"{r['step_seconds_median']:.2f} s/step",
                         f"{_f(r['examples_per_second'])} pairs/s", "", "", _load(r)])
        for r in dp["forward"]:
            paper = bench_dual_path.PAPER_MS_PER_BATCH[r["tower"]]
            what = ("dual-path image CNN forward (ResNet-50, 224²), batch 32"
                    if r["tower"] == "image" else
                    "dual-path text CNN forward (paper layout, w 64, L 32), batch 32")
            unit = "images/s" if r["tower"] == "image" else "sentences/s"
            rows.append(["forward", what, r["precision"], f"{1000 * r['seconds_median']:.0f} ms",
                         f"{_f(r['items_per_second'])} {unit}",
                         f"paper (1080Ti) {paper:.0f} ms: {1000 * r['seconds_median'] / paper:.1f}x",
                         "", _load(r)])
    evals = report.get("evaluation", [])
    base = next((e for e in evals if e["images"] == 5000), evals[0] if evals else None)
    for e in evals:
        pairs = e["images"] * e["captions"]
        t = e["warm_seconds"]
        rel_pairs = pairs / (base["images"] * base["captions"])
        rows.append(["eval", f"retrieval_metrics {e['images'] // 1000}K x {e['captions'] // 1000}K, "
                     f"512-d, chunk {e['chunk_size']}", "float32", f"{t:.3f} s",
                     f"{t / pairs * 1e9:.2f} ns/pair",
                     f"time {t / base['warm_seconds']:.2f}x, pairs {rel_pairs:.2f}x of 5K",
                     f"{common.fmt_bytes(e['warm_peak_bytes'])} warm, "
                     f"{common.fmt_bytes(e['cold_peak_bytes'])} cold (block bound "
                     f"{common.fmt_bytes(e['chunk_bound_bytes'])}; full matrix "
                     f"{common.fmt_bytes(e['full_matrix_bytes'])})", _load(e)])
    pipes = report.get("pipelines", {})
    emb = next((r for r in report["two_branch"]
                if r["kind"] == "embedding" and r["precision"] == "float32"), None)
    if "image_sentence" in pipes and emb:
        p = pipes["image_sentence"]
        steps = 1 / emb["step_seconds_median"]
        rows.append(["input", "image_sentence_batches + attach_features (500x4096 + 1000x6000 "
                     "float32)", "", f"{1 / p['batches_per_second']:.3f} s/batch",
                     f"{p['batches_per_second']:.1f} batches/s",
                     _keeps(p["batches_per_second"], steps, "embedding step"), "", _load(p)])
        fed = next((r for r in report.get("two_branch_fed", [])), None)
        if fed:
            notes.append(f"embedding step fed by that pipeline: {fed['step_seconds_median']:.3f} "
                         f"s/step ({100 * emb['step_seconds_median'] / fed['step_seconds_median']:.0f}%"
                         f" of the fixed-batch step rate; both share the 2 cores)")
    if pl:
        rows.append(["input", "phrase_embedding_batches + attach_phrase_features (Algorithm 1)",
                     "", f"{pl['pipeline_seconds'] / pl['pipeline_batches']:.3f} s/batch",
                     f"{pl['pipeline_batches_per_second']:.1f} batches/s",
                     _keeps(pl["pipeline_batches_per_second"], pl["steps_per_second_fixed"],
                            "phrase step") + f"; fed {pl['steps_per_second_fed']:.2f} steps/s", "",
                     _load(pl)])
    if dp and dp.get("pipeline"):
        p = dp["pipeline"]
        fastest = min(dp["steps"], key=lambda r: r["step_seconds_median"])
        rows.append(["input", f"dual_path.train_dataset, {p['train_images']:,} real JPEGs, "
                     f"224 crops, batch 32", "", f"{1 / p['batches_per_second']:.3f} s/batch",
                     f"{p['batches_per_second']:.1f} batches/s ({p['images_per_second']:.0f} img/s)",
                     _keeps(p["batches_per_second"], 1 / fastest["step_seconds_median"],
                            f"fastest dual-path step (Stage {'I' * fastest['stage']}, "
                            f"{fastest['precision']})"), "", _load(p)])
    for system, title in (("fragments", "fragment_batches.train_dataset (100 images x 20 x 4096 float16 rows)"),
                          ("npair", "npair_batches.train_dataset (64 maps 14 x 14 x 512 float16)")):
        p = pipes.get(system)
        if p:
            rows.append(["input", f"{title}, {p['images']:,} memory-mapped training images (page cache)", "",
                         f"{1 / p['batches_per_second']:.3f} s/batch", f"{p['batches_per_second']:.1f} batches/s",
                         _keeps(p["batches_per_second"], p["steps_per_second_fixed"],
                                f"paper-size {system} step") + f"; fed {p['steps_per_second_fed']:.2f} steps/s",
                         "", _load(p)])
    notes += [
        "Training: Keras compiled train function on a fixed in-memory batch, median of the timed "
        "steps after warm-up; random weights; two-branch models Adam, dual path SGD momentum 0.9; "
        "mixed_bfloat16 = tf_twobranch.speed.set_precision (variables, losses float32).",
        "Fraction of peak: counted matmul FLOPs of the embedding step "
        f"({flops / 1e9:.1f} GFLOP, bench_embedding.FLOP_FORMULA) / s/step / the float32 matmul "
        "peak (best float32 matmul figure of the run: load only lowers figures); the "
        "same-process figure divides by a float32 2048² matmul timed between the steps of the "
        "same subprocess (both see the same load from other processes). For mixed_bfloat16 the "
        "same FLOPs are set against the float32 peak.",
        "Evaluation: retrieval_metrics (both directions, R@1/5/10, medr, meanr) on random unit "
        "vectors, best of the warm calls; time grows ~ images x captions (ns/pair roughly "
        "constant); memory is bounded by the chunk: the core holds one (images x 2048-caption) "
        "block (images x 2048 x 5 B, 'block bound'), so it grows with images x chunk, never with "
        "the full images x captions matrix. Peak = RSS increase (VmHWM) over the process after "
        "imports and inputs; 'cold' = first call incl. tracing/XLA compilation.",
        "Load: the 1-minute load average when the measurement ended (2 cores; above ~2 other "
        "processes were competing for them, which lowers every figure).",
        "Input: pipeline alone, batches/s after warm-up; 'keeps up' when its batches/s >= the "
        "consuming step's steps/s (the pipeline then costs only its share of the 2 cores).",
    ]
    return rows, notes


def matmul_peak(report: dict) -> tuple[float, str]:
    """The float32 matmul peak: the best float32 matmul figure measured in the run.

    Load from other processes only lowers a figure, so on a shared machine
    the best of the 7-shape measurement and of the 2048² matmuls timed
    between the training steps is the closest to the unloaded peak.
    """
    mm = report["matmul"]
    interleaved = [r["matmul_gflops_same_process"] for r in report.get("two_branch", [])
                   if "matmul_gflops_same_process" in r]
    best_interleaved = max(interleaved, default=0.0)
    if best_interleaved > mm["best_gflops"]:
        return best_interleaved, (f"2048² matmul between training steps (7-shape measurement: "
                                  f"{mm['best_gflops']:.0f}, best shape {mm['best_shape']}, "
                                  f"load {mm.get('loadavg', [float('nan')])[0]:.1f})")
    return mm["best_gflops"], f"best of 7 shapes: {mm['best_shape']}"


def _load(record: dict) -> str:
    """1-minute load average recorded with a measurement (other processes share the cores)."""
    load = record.get("loadavg")
    if isinstance(load, (list, tuple)):
        load = load[0]
    return f"{load:.1f}" if isinstance(load, (int, float)) else ""


def _keeps(batches_per_second: float, steps_per_second: float, what: str) -> str:
    verdict = "keeps up" if batches_per_second >= steps_per_second else "DOES NOT keep up"
    return f"{verdict}: {what} {steps_per_second:.2f} steps/s"


def markdown_table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _title(quick: bool, day: str) -> str:
    return "tf_twobranch benchmarks at paper sizes" + (" (--quick)" if quick else "") + f" — {day}"


def _write_markdown(report, rows, notes, path, quick, seconds, day) -> str:
    m = report["machine"]
    end = report.get("loadavg_end") or [float("nan")]
    machine = (f"{m['cpu_model']}, {m['cpu_count']} cores ({', '.join(m['simd_flags'])}), "
               f"{m['mem_total_gib']} GiB, TF {m.get('tensorflow')}, Keras {m.get('keras')}; "
               f"load average {report['loadavg_start'][0]:.2f} at start, {end[0]:.2f} at end "
               f"(shared machine: other processes used the 2 cores too)")
    md = [f"### {_title(quick, day)}", "", machine, "", markdown_table(HEADERS, rows), ""]
    md += [f"* {n}" for n in notes]
    md.append(f"\nCommand: `python -m benchmarks.run_all{' --quick' if quick else ''}` "
              f"({seconds:.0f} s).")
    text = "\n".join(md) + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a few minutes: fewer repetitions, no 25K x 125K gallery")
    parser.add_argument("--out_json", default="benchmarks/results/run_all.json")
    parser.add_argument("--out_md", default="benchmarks/results/run_all.md")
    parser.add_argument("--from_json", default=None,
                        help="rebuild the table and markdown from an earlier run's JSON "
                             "(no measurement)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: two_branch, "
                        "phrase, dual_path, eval, pipelines")
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # inherited by the spawn children
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            report = json.load(f)
        rows, notes = build_rows(report)
        lines = [f"Rebuilt from {args.from_json} (measured {report.get('started')})", "",
                 common.format_table(HEADERS, rows)] + ["  " + n for n in notes]
        print("\n".join(lines))
        _write_markdown(report, rows, notes, args.out_md, report.get("quick", False),
                        report.get("wall_seconds", 0.0), report.get("started", "")[:10])
        return
    report, lines, started = common.start_report(quick=args.quick)

    _log("matmul peak")
    report["matmul"] = (common.measure_matmul_gflops(repeats=3, min_seconds=0.2) if args.quick
                        else common.measure_matmul_gflops())
    report["matmul"]["loadavg"] = os.getloadavg()
    report["two_branch"] = [] if "two_branch" in skip else measure_two_branch(args.quick)
    if "phrase" not in skip:
        report["phrase_localization"] = measure_phrase_localization(args.quick)
    if "dual_path" not in skip:
        report["dual_path"] = bench_dual_path.measure(quick=args.quick)
    if "eval" not in skip:
        report["evaluation"] = measure_evaluation(args.quick)
    report["pipelines"] = {}
    if "pipelines" not in skip:
        _log("image_sentence pipeline")
        report["pipelines"]["image_sentence"] = common.run_in_subprocess(
            bench_embedding.pipeline_child, 10 if args.quick else 30, 3)
        for system in FED_SYSTEMS:
            _log(f"{system} pipeline, paper-size step fixed and fed")
            report["pipelines"][system] = measure_fed_pipeline(system, args.quick)
        if not args.quick:
            _log("embedding step fed by the image_sentence pipeline")
            report["two_branch_fed"] = [common.run_in_subprocess(
                bench_embedding._train_child, False, "tfdata", "package", 10, 3, None)]

    rows, notes = build_rows(report)
    report["loadavg_end"] = os.getloadavg()
    lines.append(common.format_table(HEADERS, rows, title=_title(args.quick,
                                                                 time.strftime("%Y-%m-%d"))))
    lines += ["  " + n for n in notes]
    report["markdown"] = _write_markdown(report, rows, notes, args.out_md, args.quick,
                                         time.time() - started, time.strftime("%Y-%m-%d"))
    common.finish_report(report, lines, started, args.out_json)
    print(f"wrote {args.out_md}")


if __name__ == "__main__":
    # Subprocess targets must be importable by name, not as __main__.
    from benchmarks import run_all
    run_all.main()
