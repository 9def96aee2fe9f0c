r"""Runs every row of TPAMI Table 2 (Flickr30K) or Table 3 (MSCOCO 1K) and prints it.

    python -m experiments.retrieval_table                 # Table 2 on the embedded data
    python -m experiments.retrieval_table --table=3 --dataset_dir=/data/coco ...

Each row is a flagfile in experiments/configs/ (table<N>_*.cfg), runnable on
its own with `python -m experiments.image_sentence_retrieval --flagfile=...`;
either way its run folder is runs/<flagfile stem> (tf_twobranch.table_runner).
Flags given here after the runner's own (e.g. --dataset_dir, --epochs, --smoke)
are passed to every row. Rows that finished earlier with the same arguments
are reused (--noresume runs them again). Features are computed once and
cached. The full model's row is exported as a SavedModel.
"""
from __future__ import annotations

import pathlib
import sys
import time

from absl import app, flags

from experiments import common
from experiments import image_sentence_retrieval as isr
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, exit_with_user_error, expand_flagfiles, parse_flags
from tf_twobranch.data.embedded import default_dataset_dir
from tf_twobranch.errors import UserInputError
from tf_twobranch.speed import best_matmul_seconds

FLAGS = flags.FLAGS
# The rows the default run trains (each under ~1 minute on the embedded data).
MAIN_ROWS = ("_a1_", "_b2_", "_b4_", "_b5_", "_b6_", "_d_")

# Seconds of the default job's phases on the machine of BUILD_NOTES.md ("Main job
# time", session 9: the quiet cold run, 2-core AVX-512 EPYC), whose TensorFlow
# matmul probe (`_matmul_gflops`) read about REFERENCE_GFLOPS; the estimate scales
# them by this machine's probe. "row" is any row outside the default six (LSTM,
# single-directional).
REFERENCE_GFLOPS = 190.0
REFERENCE_SECONDS = {"dataset": 12, "features": 99, "_a1_": 2, "_b2_": 16, "_b4_": 32,
                     "_b5_": 45, "_b6_": 55, "_d_": 76, "row": 80}
# Most of the job does not speed up with the matmul probe: on an AMX machine whose probe
# read 369 GFLOP/s (1.94x the reference) the job took 298 s, 0.88x the reference's 339 s
# (session 13). So a faster probe is credited down to this factor only, and the printed
# range (SPREAD) covers the AVX2 machines, where the job ran up to ~1.2x slower than the
# probe predicts.
FASTEST_FACTOR = 0.85
SPREAD = 1.3


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The runner's own flags; every other flag goes to the rows (see `_row_overrides`)."""
    d = dict(flag_values=fv)
    flags.DEFINE_enum("table", "2", ["2", "3"], "2: Flickr30K rows; 3: MSCOCO 1K rows.", **d)
    common.define_runner_flags(fv, rows_help=(
        "Row flagfiles (names in experiments/configs or paths), or 'all' for every "
        "table<N>_*.cfg; default: the main rows (CCA, linear and nonlinear bi-directional, "
        "neighbourhood sampling, + constraints, similarity network) — the LSTM and "
        "single-directional rows need --rows=all."), runs_dir=False)
    flags.DEFINE_string("export_row", "b6", "Row whose model is exported (substring of its "
                        "flagfile name); empty: none.", **d)
    flags.DEFINE_string("out_json", "", "Results of all rows (default <runs_dir>/table<N>.json).", **d)
    flags.DEFINE_string("runs_dir", "", "Parent folder of the rows' run folders (default runs/ in "
                        "the repository).", **d)


def _matmul_gflops() -> float:
    """A quick (~0.1 s) probe of this machine's speed: the best of a few float32 `tf.matmul`s.

    TensorFlow's matmul (oneDNN on the package's default) is what the rows
    run; numpy's BLAS ranks machines differently (with TensorFlow loaded it
    read 135 GFLOP/s on a machine whose TensorFlow matmul reads 200).
    """
    return 2 * 1024 ** 3 / best_matmul_seconds(1024, 1024, 1024, warmups=3, repeats=8) / 1e9


def estimate_seconds(configs, dataset_ready: bool, features_ready: bool) -> float:
    """The default job's expected wall time on this machine (embedded data)."""
    total = (0 if dataset_ready else REFERENCE_SECONDS["dataset"]) + \
        (0 if features_ready else REFERENCE_SECONDS["features"])
    for cfg in configs:
        key = next((k for k in MAIN_ROWS if k in cfg.stem), "row")
        total += REFERENCE_SECONDS[key]
    return total * max(REFERENCE_GFLOPS / max(_matmul_gflops(), 1e-3), FASTEST_FACTOR)


def _print_estimate(configs, overrides) -> None:
    if any(_flag_name(o) == "dataset_dir" for o in overrides):
        print(f"Estimated time: depends on your dataset's size ({len(configs)} rows).", flush=True)
        return
    dataset = default_dataset_dir()
    dataset_ready = (dataset / "MANIFEST.json").exists()
    features_ready = dataset_ready and any((dataset / "features").glob("image_scene_cnn_*"))
    seconds = estimate_seconds(configs, dataset_ready, features_ready)
    low, high = seconds / 60, seconds * SPREAD / 60
    print(f"Estimated time on this machine: {low:.0f}–{max(high, low + 1):.0f} min for {len(configs)} rows"
          f"{'' if features_ready else ' (first run: dataset and features are computed and cached)'}.",
          flush=True)


def _flag_name(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0]


def _expanded_argv(argv: list[str]) -> list[str]:
    """`argv` with its flagfiles expanded: a flagfile given here may hold the runner's flags
    (--rows) as well as flags for every row."""
    return [argv[0], *(a.text for a in expand_flagfiles(argv[1:]))]


def _row_overrides(argv: list[str]) -> list[str]:
    """Flags that belong to the rows: everything the runner (and absl) does not define."""
    return table_runner.row_arguments(argv[1:], list(FLAGS))


def format_table(records: list[dict], table: str) -> str:
    """The rows' table, one per protocol and test split (rows are compared only on the same
    split): each row beside the paper's numbers measured under its protocol, then chance."""
    tables = []
    for group in common.groups_by_test_split(records):
        first = group[0]
        title = common.table_title(
            f"Table {table}-style bi-directional retrieval", dataset=first["dataset_dir"],
            protocol=first["protocol"], num_images=first["num_test_images"],
            num_captions=first["num_test_captions"], paper=any(r["paper"] for r in group),
            paper_dataset=first["paper_dataset"], paper_protocol=first["paper_protocol"],
            smoke=any(common.is_smoke(r) for r in group))
        rows = [{"name": r["row"], "metrics": r["metrics"], "paper": common.paper_beside_record(r)} for r in group]
        notes = sorted({r["protocol_note"] for r in group if r.get("protocol_note")})
        tables.append("\n".join([common.format_retrieval_table(title, rows, chance=first["random_baseline"]),
                                  *(f"note: {n}" for n in notes)]))
    return "\n\n".join(tables)


def _run_row(cfg, arguments) -> dict:
    return isr.run(common.parse_flagfile(isr.define_flags, str(cfg), arguments))


def _announce(cfg, record, reused) -> None:
    print(f"{cfg.name}: {record['row']}", flush=True)
    print(isr.format_record(record), flush=True)


def _main() -> None:
    overrides = _row_overrides(_expanded_argv(sys.argv))
    runs_dir = pathlib.Path(FLAGS.runs_dir) if FLAGS.runs_dir else table_runner.default_runs_dir()
    configs = table_runner.select_rows(
        FLAGS.rows, pattern=f"table{FLAGS.table}_*.cfg",
        default=lambda every: [c for c in every if any(k in c.stem for k in MAIN_ROWS)])
    _print_estimate(configs, overrides)
    start = time.time()

    def export(cfg) -> list[str]:
        return [f"--export={str(bool(FLAGS.export_row) and FLAGS.export_row in cfg.stem).lower()}"]

    records = table_runner.run_table(configs, _run_row, overrides=overrides, runs_dir=runs_dir,
                                     extra_arguments=export, resume=FLAGS.resume, announce=_announce,
                                     is_chief=common.is_chief)
    print()
    print(format_table(records, FLAGS.table))
    s2s = [(r["row"], r["sentence_retrieval"]) for r in records if "sentence_retrieval" in r]
    if s2s:
        print("\nSentence-to-sentence retrieval (Table 4 protocol):")
        for name, m in s2s:
            print(f"  {name:55s} R@1 {m['s2s_r1']:5.1f}  R@5 {m['s2s_r5']:5.1f}  "
                  f"R@10 {m['s2s_r10']:5.1f}")
    exported = [r["export_dir"] for r in records if r.get("export_dir")]
    for e in exported:
        print(f"SavedModel: {e}")
    out = FLAGS.out_json or runs_dir / f"table{FLAGS.table}.json"
    common.write_json(out, {"rows": records, "seconds": time.time() - start})
    print(f"results: {out} ({time.time() - start:.0f} s)")
    last = next((r for r in reversed(records) if r.get("export_dir")), records[-1])
    print(isr.follow_up(last))


main = absl_main(_main)


def _absl_argv(argv: list[str]) -> list[str]:
    """The runner's own flags (absl's included) and every positional argument (rejected as
    stray by absl_main)."""
    return [argv[0]] + [a for a in argv[1:] if not a.startswith("-") or _flag_name(a) in FLAGS]


def _parse_runner_flags(argv: list[str]) -> list[str]:
    """The runner's flags (from the command line or its flagfiles); row flags are parsed per row."""
    try:
        expanded = _expanded_argv(argv)
    except UserInputError as err:
        exit_with_user_error(err)
    return parse_flags(_absl_argv(expanded))


if __name__ == "__main__":
    define_flags()
    # app.run would define --help & co. only after the filter below: define them first, so
    # they count as the runner's own.
    app.define_help_flags()
    # Row flags are parsed per row (see _row_overrides); absl sees only its own.
    app.run(main, flags_parser=_parse_runner_flags)
