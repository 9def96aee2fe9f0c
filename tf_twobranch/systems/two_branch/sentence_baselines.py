"""Sentence-to-sentence retrieval with text-only features (TPAMI 2018 §5.5, Table 4): every text
encoder fitted on the training captions, each test caption querying the other test captions
(`experiments.two_branch_sentence_baselines` is its command line)."""
from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import numpy as np

from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.data.formats.word_vectors import load_word_vectors
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import UserInputError

__all__ = ["sentence_baselines", "format_table", "SMOKE_CAPS"]

# --smoke (experiments.two_branch_sentence_baselines): small encoders.
SMOKE_CAPS = {"num_components": 4, "max_fit_words": 2000, "word_vector_dim": 32}

logger = logging.getLogger("two_branch_sentence_baselines")


def _load_split(corpus, layout, split: str):
    """The split's images that have captions, and how many of its ids have none."""
    ids = layout.split_ids(split)
    path = str(layout.split_files[split])
    known = set(corpus.image_ids)
    present = [i for i in ids if i in known]
    if not present:
        raise UserInputError(f"{path}: none of its {len(ids)} image ids has captions in {corpus.source}")
    return corpus.subset(present, source=path), len(ids) - len(present), len(ids)


def sentence_baselines(captions: str, train_split: str, test_split: str, encoders: Sequence[str], *,
                       word_vectors_file: str | None, word_vector_dim: int, num_components: int,
                       max_fit_words: int, ica: bool, pca_dim: int | None, tfidf_max_features: int,
                       seed: int) -> dict:
    """Fits every encoder on the training captions and evaluates Table 4 on the test captions;
    returns the results record (with chance: random vectors ranked the same way)."""
    # TensorFlow (the retrieval core) and scikit-learn: only when it runs, so --help starts fast.
    from tf_twobranch.evaluation.retrieval import sentence_retrieval_metrics
    from tf_twobranch.features.text_features import build_text_encoder, encoder_needs_word_vectors
    from tf_twobranch.features.word_vectors import train_word_vectors

    # The caption file and the split lists live in different folders: the
    # layout is the caption file's folder with both given explicitly.
    layout = resolve_dataset(os.path.dirname(os.path.abspath(captions)), caption_format="token",
                             captions_path=captions,
                             split_files={"train": train_split, "test": test_split})
    corpus = read_token_file(layout.caption_file)
    train, train_missing, train_total = _load_split(corpus, layout, "train")
    test, test_missing, test_total = _load_split(corpus, layout, "test")
    train_tokens = [tokenize_caption(c) for c in train.captions]
    test_tokens = [tokenize_caption(c) for c in test.captions]
    logger.info("train: %d/%d images with captions (%d captions); test: %d/%d images (%d captions)",
                train.num_images, train_total, train.num_captions, test.num_images, test_total, test.num_captions)

    word_vectors, word_vector_source, word_vector_seconds = None, None, 0.0
    if any(encoder_needs_word_vectors(n) for n in encoders):
        start = time.time()
        if word_vectors_file:
            vocabulary = {t for s in train_tokens + test_tokens for t in s}
            word_vectors = load_word_vectors(word_vectors_file, vocabulary=vocabulary)
            word_vector_source = os.path.abspath(word_vectors_file)
        else:
            logger.warning("No --word_vectors: training %d-d PPMI-SVD word vectors on the %d training captions "
                           "(stand-in for GoogleNews word2vec).", word_vector_dim, len(train_tokens))
            word_vectors = train_word_vectors(train_tokens, dim=word_vector_dim, seed=seed)
            word_vector_source = f"PPMI-SVD trained on the training captions ({len(word_vectors)} words)"
        word_vector_seconds = time.time() - start

    results = {}
    for name in encoders:
        kwargs = {}
        if encoder_needs_word_vectors(name):
            kwargs["word_vectors"] = word_vectors
        if name.startswith("fisher"):
            kwargs.update(num_components=num_components, max_fit_words=max_fit_words,
                          pca_dim=pca_dim, seed=seed, ica=ica)
        elif name == "tfidf":
            kwargs.update(max_features=tfidf_max_features)
        start = time.time()
        encoder = build_text_encoder(name, **kwargs).fit(train_tokens)
        features = encoder.transform(test_tokens)
        metrics = sentence_retrieval_metrics(features, test.caption_image, ks=(1, 5, 10))
        seconds = time.time() - start
        results[name] = {"R@1": metrics["s2s_r1"], "R@5": metrics["s2s_r5"], "R@10": metrics["s2s_r10"],
                         "medr": metrics["s2s_medr"], "dim": int(features.shape[1]),
                         "config": encoder.get_config(), "seconds": round(seconds, 1)}
        logger.info("%s: R@1 %.1f R@5 %.1f R@10 %.1f (%.0f s)", name, metrics["s2s_r1"], metrics["s2s_r5"],
                    metrics["s2s_r10"], seconds)

    # Chance: random vectors ranked the same way (what an encoder must beat).
    random_vectors = np.random.default_rng(seed).normal(size=(test.num_captions, 64)).astype(np.float32)
    chance = sentence_retrieval_metrics(random_vectors, test.caption_image, ks=(1, 5, 10))
    output = {
        "task": "two_branch_sentence_baselines", "protocol": "sentence_to_sentence",
        "protocol_description": "sentence-to-sentence retrieval (TPAMI 2018 Table 4): each test caption "
                                "queries the other test captions; positives are the other captions of the "
                                "same image; cosine similarity",
        "test_split_fingerprint": test.fingerprint(),
        "captions": os.path.abspath(captions),
        "train_split": os.path.abspath(train_split), "test_split": os.path.abspath(test_split),
        "train_images": train.num_images, "train_captions": train.num_captions,
        "train_images_without_captions": train_missing,
        "test_images": test.num_images, "test_captions": test.num_captions,
        "test_images_without_captions": test_missing,
        "word_vectors": word_vector_source, "word_vector_seconds": round(word_vector_seconds, 1),
        "results": results,
        "random_baseline": {"R@1": chance["s2s_r1"], "R@5": chance["s2s_r5"], "R@10": chance["s2s_r10"],
                            "medr": chance["s2s_medr"]},
    }
    return output


def format_table(output: dict) -> str:
    """A Table 4-style text table of the results."""
    lines = [
        f"Sentence-to-sentence retrieval (protocol {output['protocol']}), Flickr30K test: "
        f"{output['test_images']} images, {output['test_captions']} captions "
        f"({output['test_images_without_captions']} test images without captions skipped); encoders "
        f"fitted on {output['train_captions']} training captions",
        f"word vectors: {output['word_vectors']}",
        f"{'features':<14}{'dim':>7}{'R@1':>7}{'R@5':>7}{'R@10':>7}{'medr':>6}",
    ]
    for name, r in output["results"].items():
        lines.append(f"{name:<14}{r['dim']:>7}{r['R@1']:>7.1f}{r['R@5']:>7.1f}{r['R@10']:>7.1f}{r['medr']:>6.0f}")
    c = output.get("random_baseline")
    if c:
        lines.append(f"{'chance':<14}{'':>7}{c['R@1']:>7.1f}{c['R@5']:>7.1f}{c['R@10']:>7.1f}{c['medr']:>6.0f}"
                     "  (random vectors, same protocol)")
    return "\n".join(lines)
