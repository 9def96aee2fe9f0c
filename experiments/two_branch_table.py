r"""Runs every row of TPAMI Table 2 (Flickr30K) or Table 3 (MSCOCO 1K) and prints it.

    python -m experiments.two_branch_table                 # Table 2 on the embedded data
    python -m experiments.two_branch_table --table=3 --dataset_dir=/data/coco ...

Each row is a flagfile in experiments/configs/ (two_branch_table<N>_*.cfg), runnable on
its own with `python -m experiments.two_branch_retrieval --flagfile=...`;
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
from experiments import two_branch_retrieval as isr
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, exit_with_user_error, expand_flagfiles, parse_flags
from tf_twobranch.data.embedded import default_dataset_dir
from tf_twobranch.errors import UserInputError
from tf_twobranch.speed import ESTIMATE_SPREAD
from tf_twobranch.systems.two_branch.pipeline import MAIN_ROWS, format_table, main_job_seconds

FLAGS = flags.FLAGS
def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The runner's own flags; every other flag goes to the rows (see `_row_overrides`)."""
    d = dict(flag_values=fv)
    flags.DEFINE_enum("table", "2", ["2", "3"], "2: Flickr30K rows; 3: MSCOCO 1K rows.", **d)
    common.define_runner_flags(fv, rows_help=(
        "Row flagfiles (names in experiments/configs or paths), or 'all' for every "
        "two_branch_table<N>_*.cfg; default: the main rows (CCA, linear and nonlinear bi-directional, "
        "neighbourhood sampling, + constraints, similarity network) — the LSTM and "
        "single-directional rows need --rows=all."), runs_dir=False)
    flags.DEFINE_string("export_row", "b6", "Row whose model is exported (substring of its "
                        "flagfile name); empty: none.", **d)
    flags.DEFINE_string("out_json", "", "Results of all rows (default <runs_dir>/table<N>.json).", **d)
    flags.DEFINE_string("runs_dir", "", "Parent folder of the rows' run folders (default runs/ in "
                        "the repository).", **d)


def _print_estimate(configs, overrides) -> None:
    if any(_flag_name(o) == "dataset_dir" for o in overrides):
        print(f"Estimated time: depends on your dataset's size ({len(configs)} rows).", flush=True)
        return
    dataset = default_dataset_dir()
    dataset_ready = (dataset / "MANIFEST.json").exists()
    features_ready = dataset_ready and any((dataset / "features").glob("image_scene_cnn_*"))
    seconds = main_job_seconds(configs, dataset_ready, features_ready)
    low, high = seconds / 60, seconds * ESTIMATE_SPREAD / 60
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


def _run_row(cfg, arguments) -> dict:
    return isr.run(common.parse_flagfile(isr.define_flags, str(cfg), arguments))


def _announce(cfg, record, reused) -> None:
    print(f"{cfg.name}: {record['row']}", flush=True)
    print(isr.format_record(record), flush=True)


def _main() -> None:
    overrides = _row_overrides(_expanded_argv(sys.argv))
    runs_dir = pathlib.Path(FLAGS.runs_dir) if FLAGS.runs_dir else table_runner.default_runs_dir()
    configs = table_runner.select_rows(
        FLAGS.rows, pattern=f"two_branch_table{FLAGS.table}_*.cfg",
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
    out = FLAGS.out_json or runs_dir / f"two_branch_table{FLAGS.table}.json"
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
