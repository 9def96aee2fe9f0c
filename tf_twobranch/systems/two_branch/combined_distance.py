"""TPAMI Table 5 (§5.6): image–sentence retrieval with region–phrase correspondences,

    D(x, y) = (1 − α)·d(x, y) + α·d_rp(x, y),

d the Euclidean distance of the image–sentence network's L2-normalised embeddings, d_rp the mean over
the sentence's phrases of the distance from the phrase to its closest proposal of image x in the
region–phrase network's space; ranks from the evaluation core on −D blocks
(`experiments.two_branch_combined_distance` trains or finds the two runs)."""
from __future__ import annotations

import pathlib

import numpy as np
from scipy import sparse

from tf_twobranch.data.formats.flickr30k_entities import NOTVISUAL_TYPE, NULL_CHAIN_ID, read_sentence_file
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.features.prepare_regions import encode_phrases, load_phrase_encoder, split_region_features
from tf_twobranch.systems.two_branch import region_phrase_pipeline
from tf_twobranch.systems.two_branch.pipeline import RetrievalRecipe, load_data
from tf_twobranch.systems.two_branch.region_phrase_pipeline import LocalizationRecipe
from tf_twobranch.tables import format_retrieval_table, is_smoke, paper_beside_record, resolve_protocol, \
    split_record, table_title
from tf_twobranch.vectors import l2_normalize_rows

__all__ = ["sentence_phrases", "region_phrase_distances", "combined_distance_retrieval", "format_table"]


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
                raise UserInputError(f"{path}: Flickr30K Entities sentence file missing for test "
                                     f"image {image_id} (Table 5 needs the phrases of every sentence)")
            cache[image_id] = read_sentence_file(path)
        k = int(seen[image])
        seen[image] += 1
        sentences = cache[image_id]
        if k >= len(sentences):
            raise UserInputError(f"{path}: {len(sentences)} sentences, but caption {k} of image "
                                 f"{image_id} is in {corpus.source}")
        if tokenize_caption(" ".join(sentences[k].words)) != tokenize_caption(caption):
            raise UserInputError(
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


def combined_distance_retrieval(is_loaded, rp_loaded, *, alpha: float, chunk_size: int,
                                image_chunk: int) -> dict:
    """Table 5's record of two loaded runs (`runs.load_run`): an image–sentence and a region–phrase
    embedding network on one dataset, scored on the image–sentence run's test split and protocol."""
    is_run, rp_run = is_loaded.run_dir, rp_loaded.run_dir
    is_model, is_config = is_loaded.model, is_loaded.config
    rp_model, rp_config = rp_loaded.model, rp_loaded.config
    if is_model.config.kind != "embedding" or is_model.config.text_encoder != "features":
        raise UserInputError(f"{is_run}: Table 5 needs an image-sentence *embedding* network on "
                             "sentence features (not the similarity network or the LSTM)")
    if rp_model.config.kind != "embedding":
        raise UserInputError(f"{rp_run}: Table 5 needs a region-phrase *embedding* network "
                             f"(got {rp_model.config.kind})")
    # The recipes the two runs were made with (their recorded flags on the flags' defaults).
    is_flags = RetrievalRecipe.from_dict(is_config.get("flags") or {}, strict=False)
    rp_flags = LocalizationRecipe.from_dict(rp_config.get("flags") or {}, strict=False)
    layout, splits, image, text, _ = load_data(is_flags)
    dataset_dir = layout.root
    test = splits["test"]
    # Table 5 is scored under the image-sentence run's protocol, checked against this split.
    protocol = resolve_protocol(is_flags, test.num_images)
    rp_dataset = pathlib.Path(rp_flags.dataset_dir) if rp_flags.dataset_dir else None
    if rp_dataset is not None and rp_dataset.resolve() != pathlib.Path(dataset_dir).resolve():
        raise UserInputError(f"the runs used different datasets: {dataset_dir} ({is_run}) and "
                             f"{rp_dataset} ({rp_run})")
    # The same folder, with the region-phrase run's images folder and proposals.
    rp_layout = region_phrase_pipeline.dataset_layout(rp_flags, dataset_dir)
    cache = pathlib.Path(rp_flags.features_cache) if rp_flags.features_cache else dataset_dir / "features"
    spec = region_phrase_pipeline.feature_spec(rp_flags)
    encoder = load_phrase_encoder(rp_layout, cache, spec)
    spec.max_images = {k: v for k, v in (spec.max_images or {}).items() if k != "test"} or None
    regions = split_region_features(rp_layout, "test", cache, spec)
    missing = [i for i in test.image_ids if i not in regions["proposal_features"]]
    if missing:
        raise UserInputError(f"test image {missing[0]} of the captions is not in "
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
                                   [regions["proposal_features"][i] for i in test.image_ids], image_chunk)
    d_rp = np.asarray((average @ best).T, np.float32)          # (num_images, num_captions)
    has_phrases = counts > 0

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

    record = {"dataset_dir": str(dataset_dir), "image_sentence_run": str(is_run), "region_phrase_run": str(rp_run),
              "alpha": alpha, **split_record(protocol, test), "num_unique_phrases": len(table),
              "captions_without_phrases": int((~has_phrases).sum()),
              "random_baseline": retrieval.random_baseline_metrics(
                  test.num_images, test.caption_image, protocol=is_flags.protocol, seed=0)}
    for name, weighted in (("image_sentence", False), ("weighted_distance", True)):
        record[name] = retrieval.evaluate_protocol(
            np.arange(test.num_images), np.arange(test.num_captions), test.caption_image, is_flags.protocol,
            chunk_size=chunk_size, score_fn_factory=neg_distance(weighted))
    return record


def format_table(record: dict) -> str:
    paper = paper_beside_record(record) or []
    rows = [{"name": "Image-sentence model", "metrics": record["image_sentence"],
             "paper": paper[:6] if len(paper) >= 6 else None},
            {"name": f"Weighted distance (alpha={record['alpha']:g})", "metrics": record["weighted_distance"],
             "paper": paper[6:12] if len(paper) >= 12 else None}]
    title = table_title(
        "Table 5", dataset=record["dataset_dir"], protocol=record["protocol"],
        num_images=record["num_test_images"], num_captions=record["num_test_captions"],
        paper=record.get("paper"), paper_dataset=record["paper_dataset"],
        paper_protocol=record["paper_protocol"], smoke=is_smoke(record))
    return format_retrieval_table(title, rows, chance=record["random_baseline"])
