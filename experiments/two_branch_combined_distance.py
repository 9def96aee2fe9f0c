r"""Image–sentence retrieval with region–phrase correspondences (TPAMI Table 5, §5.6).

    python -m experiments.two_branch_combined_distance \
        --flagfile=experiments/configs/two_branch_table5_weighted_distance.cfg \
        --image_sentence_run=runs/two_branch_table2_b6_nonlinear_bidir_nbr_constraints \
        --region_phrase_run=runs/two_branch_table1_b5_nonlinear_augm_pos_bidir_nbr_sampling

On the test split, with x an image and y a sentence,

    D(x, y) = (1 − α)·d(x, y) + α·d_rp(x, y),   α = 0.3,

d the Euclidean distance of the image–sentence embedding network's
L2-normalised embeddings and d_rp the mean, over the sentence's phrases, of
the distance from the phrase to its closest proposal of image x in the
region–phrase embedding network's space. Ranks come from the shared
evaluation core (``ranks_from_score_fn`` on −D blocks). The sentence's
phrases are those of the Flickr30K Entities ``Sentences/<id>.txt`` line with
the caption's index (non-visual phrases excluded); the caption text and the
Entities sentence are checked to be the same words. A sentence without
phrases keeps D = d.

Without --image_sentence_run / --region_phrase_run both models are first
trained with the full-model flagfiles (two_branch_table2_b6… and two_branch_table1_b5…), with
--train_overrides (e.g. shorter schedules; --smoke adds the rows' --smoke) applied
to both, into runs/two_branch_table5/<flagfile stem> (tf_twobranch.table_runner; reused
when they finished earlier with the same arguments).
"""
from __future__ import annotations

import pathlib
import sys
import time

from absl import app, flags

from experiments import common
from experiments import two_branch_retrieval as isr
from experiments import two_branch_region_phrase as pl
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.runs import load_run
from tf_twobranch.systems.two_branch.combined_distance import combined_distance_retrieval, format_table

DEFAULT_IMAGE_SENTENCE_CFG = "two_branch_table2_b6_nonlinear_bidir_nbr_constraints"
DEFAULT_REGION_PHRASE_CFG = "two_branch_table1_b5_nonlinear_augm_pos_bidir_nbr_sampling"


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("image_sentence_run", "", "Run dir of experiments.two_branch_retrieval "
                        "(embedding network); empty: train one with --image_sentence_flagfile.", **d)
    flags.DEFINE_string("region_phrase_run", "", "Run dir of experiments.two_branch_region_phrase "
                        "(embedding network); empty: train one with --region_phrase_flagfile.", **d)
    flags.DEFINE_string("image_sentence_flagfile", DEFAULT_IMAGE_SENTENCE_CFG, "Row trained when no run is given.", **d)
    flags.DEFINE_string("region_phrase_flagfile", DEFAULT_REGION_PHRASE_CFG, "Row trained when no run is given.", **d)
    flags.DEFINE_list("train_overrides", [], "Flags passed to both trainings (e.g. --epochs=2).", **d)
    flags.DEFINE_string("dataset_dir", "", "Passed to both trainings when they are run here.", **d)
    flags.DEFINE_float("alpha", 0.3, "Weight of the region-phrase distance.", lower_bound=0.0, upper_bound=1.0, **d)
    flags.DEFINE_integer("chunk_size", 1000, "Sentences per score block.", lower_bound=1, **d)
    flags.DEFINE_integer("image_chunk", 50, "Images per block when computing phrase-to-region minima.",
                         lower_bound=1, **d)
    flags.DEFINE_string("paper_dataset", "Flickr30K", "Dataset the paper numbers are for.", **d)
    common.define_smoke_flag(fv)
    common.define_output_flags(fv, row_name="Weighted distance", verbose=0, paper_results_help=(
        "12 numbers: the image-sentence model's i2t R@1,5,10, t2i R@1,5,10, then the weighted "
        "distance's."))


def _train_missing(f) -> tuple[pathlib.Path, pathlib.Path]:
    """The two runs: given, or trained (or reused) through the table runner."""
    runs = []
    for given, cfg, module in ((f.image_sentence_run, f.image_sentence_flagfile, isr),
                               (f.region_phrase_run, f.region_phrase_flagfile, pl)):
        if given:
            runs.append(pathlib.Path(given))
            continue
        overrides = [*f.train_overrides, "--export=false", f"--verbose={f.verbose}",
                     *(["--smoke"] if f.smoke else []),
                     *([f"--dataset_dir={f.dataset_dir}"] if f.dataset_dir else [])]

        def run_row(path, arguments, module=module):
            print(f"training {path.name} ({' '.join(arguments)})", flush=True)
            return module.run(common.parse_flagfile(module.define_flags, str(path), arguments))

        record, = table_runner.run_table([cfg], run_row, overrides=overrides,
                                         runs_dir=table_runner.default_runs_dir() / "two_branch_table5",
                                         is_chief=common.is_chief)
        runs.append(pathlib.Path(record["run_dir"]))
    return runs[0], runs[1]


def run(f, flagfile: str | None = None) -> dict:
    start = time.time()
    is_run, rp_run = _train_missing(f)
    record = {"row": f.row_name, "task": "two_branch_combined_distance", **combined_distance_retrieval(
        load_run(is_run), load_run(rp_run), alpha=f.alpha, chunk_size=f.chunk_size, image_chunk=f.image_chunk),
        "paper": common.paper_numbers(f.paper_results), "paper_dataset": f.paper_dataset,
        "paper_protocol": f.paper_protocol, **common.flag_record(f)}
    record["seconds"] = time.time() - start
    run_dir = pathlib.Path(f.run_dir) if f.run_dir else table_runner.run_folder(None, flagfile, f.row_name)
    record["run_dir"] = str(run_dir)
    common.write_json(f.out_json or run_dir / "results.json", record)
    return record


def _main() -> None:
    record = run(flags.FLAGS, flagfile=table_runner.flagfile_of(sys.argv))
    print(format_table(record))
    print(table_runner.next_command(
        record["run_dir"], f"python -m experiments.two_branch_draw --run_dir={record['region_phrase_run']} "
        "--out_dir=figures", load_run=False))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
