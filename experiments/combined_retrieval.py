r"""Image–sentence retrieval with region–phrase correspondences (TPAMI Table 5, §5.6).

    python -m experiments.combined_retrieval \
        --flagfile=experiments/configs/table5_weighted_distance.cfg \
        --image_sentence_run=runs/table2_b6_nonlinear_bidir_nbr_constraints \
        --region_phrase_run=runs/table1_b5_nonlinear_augm_pos_bidir_nbr_sampling

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
trained with the full-model flagfiles (table2_b6… and table1_b5…), with
--train_overrides (e.g. shorter schedules; --smoke adds the rows' --smoke) applied
to both, into runs/table5/<flagfile stem> (tf_twobranch.table_runner; reused
when they finished earlier with the same arguments).
"""
from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
from absl import app, flags
from scipy import sparse

from experiments import common
from experiments import image_sentence_retrieval as isr
from experiments import phrase_localization as pl
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data.formats.flickr30k_entities import NOTVISUAL_TYPE, NULL_CHAIN_ID, read_sentence_file
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.evaluation import retrieval
from tf_twobranch.features.prepare_regions import encode_phrases, load_phrase_encoder, split_region_features
from tf_twobranch.runs import load_run
from tf_twobranch.vectors import l2_normalize_rows

DEFAULT_IMAGE_SENTENCE_CFG = "table2_b6_nonlinear_bidir_nbr_constraints"
DEFAULT_REGION_PHRASE_CFG = "table1_b5_nonlinear_augm_pos_bidir_nbr_sampling"


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("image_sentence_run", "", "Run dir of experiments.image_sentence_retrieval "
                        "(embedding network); empty: train one with --image_sentence_flagfile.", **d)
    flags.DEFINE_string("region_phrase_run", "", "Run dir of experiments.phrase_localization "
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


def _row_flags(define, run_config: dict):
    """The FlagValues a run was made with (from its run_config.json)."""
    fv = flags.FlagValues()
    define(fv)
    fv(["row"])
    for name, value in (run_config.get("flags") or {}).items():
        if name in fv:
            fv[name].value = value
    return fv


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
                                         runs_dir=table_runner.default_runs_dir() / "table5",
                                         is_chief=common.is_chief)
        runs.append(pathlib.Path(record["run_dir"]))
    return runs[0], runs[1]


def sentence_phrases(layout, corpus) -> list[list[str]]:
    """Phrase strings of every caption of ``corpus``, from the Entities Sentences files (checked to match)."""
    layout.require("entities", purpose="Table 5 (the phrases of every test sentence)")
    out: list[list[str]] = []
    cache: dict[str, list] = {}
    seen = np.zeros(len(corpus.image_ids), np.int64)
    for c, (caption, image) in enumerate(zip(corpus.captions, corpus.caption_image)):
        image_id = corpus.image_ids[image]
        path = layout.entities_dir / "Sentences" / f"{image_id}.txt"
        if image_id not in cache:
            if not path.is_file():
                raise common.UserInputError(f"{path}: Flickr30K Entities sentence file missing for test "
                                            f"image {image_id} (Table 5 needs the phrases of every sentence)")
            cache[image_id] = read_sentence_file(path)
        k = int(seen[image])
        seen[image] += 1
        sentences = cache[image_id]
        if k >= len(sentences):
            raise common.UserInputError(f"{path}: {len(sentences)} sentences, but caption {k} of image "
                                        f"{image_id} is in {corpus.source}")
        if tokenize_caption(" ".join(sentences[k].words)) != tokenize_caption(caption):
            raise common.UserInputError(
                f"{path}: sentence {k} ({' '.join(sentences[k].words)!r}) differs from caption {k} of image "
                f"{image_id} in {corpus.source} ({caption!r}); the files must list the same sentences in "
                "the same order")
        out.append([p.text for p in sentences[k].phrases
                    if p.chain_id != NULL_CHAIN_ID and NOTVISUAL_TYPE not in p.phrase_types])
    return out


def region_phrase_distances(rp_model, phrase_features: np.ndarray, proposal_features: list[np.ndarray],
                            image_chunk: int = 50) -> np.ndarray:
    """(num_phrases, num_images): distance of each phrase to its closest proposal of each image."""
    phrases = l2_normalize_rows(rp_model.embed_texts(phrase_features))
    out = np.empty((len(phrases), len(proposal_features)), np.float32)
    for lo in range(0, len(proposal_features), image_chunk):
        block = proposal_features[lo:lo + image_chunk]
        regions = l2_normalize_rows(rp_model.embed_images(np.concatenate([np.asarray(b) for b in block])))
        starts = np.concatenate([[0], np.cumsum([len(b) for b in block])[:-1]])
        best_cos = np.maximum.reduceat(phrases @ regions.T, starts, axis=1)
        out[:, lo:lo + len(block)] = np.sqrt(np.maximum(2.0 - 2.0 * best_cos, 0.0))
    return out


def run(f, flagfile: str | None = None) -> dict:
    start = time.time()
    is_run, rp_run = _train_missing(f)
    is_loaded, rp_loaded = load_run(is_run), load_run(rp_run)
    is_model, is_config = is_loaded.model, is_loaded.config
    rp_model, rp_config = rp_loaded.model, rp_loaded.config
    if is_model.config.kind != "embedding" or is_model.config.text_encoder != "features":
        raise common.UserInputError(f"{is_run}: Table 5 needs an image-sentence *embedding* network on "
                                    "sentence features (not the similarity network or the LSTM)")
    if rp_model.config.kind != "embedding":
        raise common.UserInputError(f"{rp_run}: Table 5 needs a region-phrase *embedding* network "
                                    f"(got {rp_model.config.kind})")
    is_flags = _row_flags(isr.define_flags, is_config)
    rp_flags = _row_flags(pl.define_flags, rp_config)
    layout, splits, image, text, _ = isr.load_data(is_flags)
    dataset_dir = layout.root
    test = splits["test"]
    # Table 5 is scored under the image-sentence run's protocol, checked against this split.
    protocol = common.resolve_protocol(is_flags, test.num_images)
    rp_dataset = pathlib.Path(rp_flags.dataset_dir) if rp_flags.dataset_dir else None
    if rp_dataset is not None and rp_dataset.resolve() != pathlib.Path(dataset_dir).resolve():
        raise common.UserInputError(f"the runs used different datasets: {dataset_dir} ({is_run}) and "
                                    f"{rp_dataset} ({rp_run})")
    # The same folder, with the region-phrase run's images folder and proposals.
    rp_layout = pl.dataset_layout(rp_flags, dataset_dir)
    cache = pathlib.Path(rp_flags.features_cache) if rp_flags.features_cache else dataset_dir / "features"
    spec = pl.feature_spec(rp_flags)
    encoder = load_phrase_encoder(rp_layout, cache, spec)
    spec.max_images = {k: v for k, v in (spec.max_images or {}).items() if k != "test"} or None
    regions = split_region_features(rp_layout, "test", cache, spec)
    missing = [i for i in test.image_ids if i not in regions["proposal_features"]]
    if missing:
        raise common.UserInputError(f"test image {missing[0]} of the captions is not in "
                                    f"{rp_layout.split_files.get('test', dataset_dir / 'test.txt')} "
                                    f"({len(missing)} missing)")
    # Global model: d(x, y) on the unit sphere.
    img = l2_normalize_rows(is_model.embed_images(image["test"]))
    txt = l2_normalize_rows(is_model.embed_texts(text["test"]))
    # Region-phrase model: phrase-to-best-region distances per unique phrase string.
    phrases = sentence_phrases(rp_layout, test)
    table: dict[str, int] = {}
    rows, cols = [], []
    for c, plist in enumerate(phrases):
        for p in plist:
            rows.append(c)
            cols.append(table.setdefault(p.lower(), len(table)))
    counts = np.bincount(np.asarray(rows, np.int64), minlength=len(phrases)).astype(np.float32)
    weights = 1.0 / np.maximum(counts[rows], 1.0) if rows else np.zeros(0, np.float32)
    average = sparse.csr_matrix((weights, (rows, cols)), shape=(len(phrases), max(1, len(table))))
    phrase_feats = encode_phrases(encoder, list(table)) if table else np.zeros((1, encoder.output_dim), np.float32)
    best = region_phrase_distances(rp_model, phrase_feats,
                                   [regions["proposal_features"][i] for i in test.image_ids], f.image_chunk)
    d_rp = np.asarray((average @ best).T, np.float32)          # (num_images, num_captions)
    has_phrases = counts > 0
    alpha = f.alpha

    def neg_distance(weighted: bool):
        # A protocol's fold passes the indices of its images and captions.
        def factory(images, captions):
            def score(a, b):
                rows = captions[a:b]
                d = np.sqrt(np.maximum(2.0 - 2.0 * img[images] @ txt[rows].T, 0.0))
                if not weighted:
                    return -d
                mix = (1.0 - alpha) * d + alpha * d_rp[np.ix_(images, rows)]
                return -np.where(has_phrases[rows][None, :], mix, d)
            return score
        return factory

    record = {"row": f.row_name, "task": "combined_retrieval", "dataset_dir": str(dataset_dir),
              "image_sentence_run": str(is_run), "region_phrase_run": str(rp_run), "alpha": alpha,
              **common.split_record(protocol, test), "num_unique_phrases": len(table),
              "captions_without_phrases": int((~has_phrases).sum()),
              "paper": common.paper_numbers(f.paper_results), "paper_dataset": f.paper_dataset,
              "paper_protocol": f.paper_protocol, **common.flag_record(f),
              "random_baseline": retrieval.random_baseline_metrics(
                  test.num_images, test.caption_image, protocol=is_flags.protocol, seed=0)}
    for name, weighted in (("image_sentence", False), ("weighted_distance", True)):
        record[name] = retrieval.evaluate_protocol(
            np.arange(test.num_images), np.arange(test.num_captions), test.caption_image, is_flags.protocol,
            chunk_size=f.chunk_size, score_fn_factory=neg_distance(weighted))
    record["seconds"] = time.time() - start
    run_dir = pathlib.Path(f.run_dir) if f.run_dir else table_runner.run_folder(None, flagfile, f.row_name)
    record["run_dir"] = str(run_dir)
    common.write_json(f.out_json or run_dir / "results.json", record)
    return record


def format_table(record: dict) -> str:
    paper = common.paper_beside_record(record) or []
    rows = [{"name": "Image-sentence model", "metrics": record["image_sentence"],
             "paper": paper[:6] if len(paper) >= 6 else None},
            {"name": f"Weighted distance (alpha={record['alpha']:g})", "metrics": record["weighted_distance"],
             "paper": paper[6:12] if len(paper) >= 12 else None}]
    title = common.table_title(
        "Table 5", dataset=record["dataset_dir"], protocol=record["protocol"],
        num_images=record["num_test_images"], num_captions=record["num_test_captions"],
        paper=record.get("paper"), paper_dataset=record["paper_dataset"],
        paper_protocol=record["paper_protocol"], smoke=common.is_smoke(record))
    return common.format_retrieval_table(title, rows, chance=record["random_baseline"])


def _main() -> None:
    record = run(flags.FLAGS, flagfile=table_runner.flagfile_of(sys.argv))
    print(format_table(record))
    print(table_runner.next_command(
        record["run_dir"], f"python -m experiments.draw_localization --run_dir={record['region_phrase_run']} "
        "--out_dir=figures", load_run=False))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
