r"""Sentence-to-sentence retrieval with text-only features (TPAMI 2018 §5.5, Table 4).

Each test caption queries all other test captions; its positives are the
other captions of the same image; R@1/5/10 (cosine similarity). The papers
report this protocol for their learned embeddings (Flickr30K: 60.5-63.8 R@1);
here it is run on the raw text features the embedding network starts from
(tf-idf, mean word vector, HGLMM Fisher vector), fitted on the real Flickr30K
training captions, as a reference point for the learned embeddings.

Without --word_vectors, 300-d count-based vectors (PPMI + truncated SVD) are
trained on the training captions in place of GoogleNews word2vec (which is not
available offline). Test images absent from the caption file are skipped and
counted in the output. FastICA before the mixture (the papers' setting) is
optional (--ica) because it takes minutes on 2 cores; with it, fisher_hglmm
reached R@1/5/10 36.0/56.8/65.5 instead of 33.2/53.3/61.7 (PPMI-SVD vectors).

  python -m experiments.sentence_retrieval_baselines --out_json=table4_baselines.json
"""
from __future__ import annotations

import logging
import os
import pathlib
import time

import numpy as np
from absl import app, flags

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.data.formats.word_vectors import load_word_vectors
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.json_files import write_json
from tf_twobranch.recipes import capped, define_smoke_flag, smoke_overrides

_REALDATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "realdata"

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("captions", str(_REALDATA / "flickr30k" / "captions_multi30k.token"),
                        "Caption file in the Flickr30K token layout.", **d)
    flags.DEFINE_string("train_split", str(_REALDATA / "flickr30k_entities" / "train.txt"),
                        "Training image ids (encoders are fitted on their captions).", **d)
    flags.DEFINE_string("test_split", str(_REALDATA / "flickr30k_entities" / "test.txt"),
                        "Test image ids.", **d)
    flags.DEFINE_list("encoders", ["tfidf", "mean_vector", "fisher_hglmm"],
                      "Text encoders to evaluate (tfidf, mean_vector, fisher_hglmm, fisher_gmm).", **d)
    flags.DEFINE_string("word_vectors", None, "Optional local word2vec/GloVe file; default: PPMI-SVD "
                        "vectors trained on the training captions.", **d)
    flags.DEFINE_integer("word_vector_dim", 300, "Dimension of the trained word vectors.", **d)
    flags.DEFINE_integer("num_components", 30, "Fisher vector mixture components (papers: 30).", **d)
    flags.DEFINE_integer("max_fit_words", 20_000, "Distinct training words used to fit the mixture.", **d)
    flags.DEFINE_bool("ica", False, "FastICA on the word vectors before the Fisher-vector mixture, as in "
                      "the papers (about +3 R@1 for fisher_hglmm, but adds minutes on 2 cores).", **d)
    flags.DEFINE_integer("pca_dim", None, "Optional PCA of the Fisher vectors (papers: 6000; slow). "
                         "Default: none.", **d)
    flags.DEFINE_integer("tfidf_max_features", 3000, "tf-idf dictionary size (papers: 3000 on Flickr30K).",
                         **d)
    flags.DEFINE_integer("seed", 0, "Seed of every random choice.", **d)
    flags.DEFINE_string("out_json", None, "Where to write the results (JSON).", **d)
    define_smoke_flag(fv)


logger = logging.getLogger("sentence_retrieval_baselines")


def _load_split(corpus, layout, split: str):
    """The split's images that have captions, and how many of its ids have none."""
    ids = layout.split_ids(split)
    path = str(layout.split_files[split])
    known = set(corpus.image_ids)
    present = [i for i in ids if i in known]
    if not present:
        raise UserInputError(f"{path}: none of its {len(ids)} image ids has captions in {corpus.source}")
    return corpus.subset(present, source=path), len(ids) - len(present), len(ids)


def run() -> dict:
    """Fits every encoder on the training captions and evaluates Table 4 on the test captions."""
    # These pull in TensorFlow (the retrieval core) and scikit-learn: only when the tool runs,
    # so --help starts fast (this module imports neither at start-up).
    from tf_twobranch.evaluation.retrieval import sentence_retrieval_metrics
    from tf_twobranch.features.text_features import build_text_encoder, encoder_needs_word_vectors
    from tf_twobranch.features.word_vectors import train_word_vectors

    if FLAGS.smoke:
        for name, cap in smoke_overrides("sentence_baselines").items():
            FLAGS[name].value = capped(name, FLAGS[name].value, cap)
    for name in FLAGS.encoders:
        encoder_needs_word_vectors(name)  # raises ConfigError for unknown names
    for path in (FLAGS.captions, FLAGS.train_split, FLAGS.test_split):
        if not os.path.isfile(path):
            raise ConfigError(f"file not found: {path}")
    for name in ("word_vector_dim", "num_components", "max_fit_words", "tfidf_max_features"):
        if getattr(FLAGS, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(FLAGS, name)}")

    # The caption file and the split lists live in different folders: the
    # layout is the caption file's folder with both given explicitly.
    layout = resolve_dataset(os.path.dirname(os.path.abspath(FLAGS.captions)), caption_format="token",
                             captions_path=FLAGS.captions,
                             split_files={"train": FLAGS.train_split, "test": FLAGS.test_split})
    corpus = read_token_file(layout.caption_file)
    train, train_missing, train_total = _load_split(corpus, layout, "train")
    test, test_missing, test_total = _load_split(corpus, layout, "test")
    train_tokens = [tokenize_caption(c) for c in train.captions]
    test_tokens = [tokenize_caption(c) for c in test.captions]
    logger.info("train: %d/%d images with captions (%d captions); test: %d/%d images (%d captions)",
                train.num_images, train_total, train.num_captions, test.num_images, test_total, test.num_captions)

    word_vectors, word_vector_source, word_vector_seconds = None, None, 0.0
    if any(encoder_needs_word_vectors(n) for n in FLAGS.encoders):
        start = time.time()
        if FLAGS.word_vectors:
            vocabulary = {t for s in train_tokens + test_tokens for t in s}
            word_vectors = load_word_vectors(FLAGS.word_vectors, vocabulary=vocabulary)
            word_vector_source = os.path.abspath(FLAGS.word_vectors)
        else:
            logger.warning("No --word_vectors: training %d-d PPMI-SVD word vectors on the %d training captions "
                           "(stand-in for GoogleNews word2vec).", FLAGS.word_vector_dim, len(train_tokens))
            word_vectors = train_word_vectors(train_tokens, dim=FLAGS.word_vector_dim, seed=FLAGS.seed)
            word_vector_source = f"PPMI-SVD trained on the training captions ({len(word_vectors)} words)"
        word_vector_seconds = time.time() - start

    results = {}
    for name in FLAGS.encoders:
        kwargs = {}
        if encoder_needs_word_vectors(name):
            kwargs["word_vectors"] = word_vectors
        if name.startswith("fisher"):
            kwargs.update(num_components=FLAGS.num_components, max_fit_words=FLAGS.max_fit_words,
                          pca_dim=FLAGS.pca_dim, seed=FLAGS.seed, ica=FLAGS.ica)
        elif name == "tfidf":
            kwargs.update(max_features=FLAGS.tfidf_max_features)
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
    random_vectors = np.random.default_rng(FLAGS.seed).normal(size=(test.num_captions, 64)).astype(np.float32)
    chance = sentence_retrieval_metrics(random_vectors, test.caption_image, ks=(1, 5, 10))
    output = {
        "task": "sentence_retrieval_baselines", "protocol": "sentence_to_sentence",
        "protocol_description": "sentence-to-sentence retrieval (TPAMI 2018 Table 4): each test caption "
                                "queries the other test captions; positives are the other captions of the "
                                "same image; cosine similarity",
        "test_split_fingerprint": test.fingerprint(),
        "captions": os.path.abspath(FLAGS.captions),
        "train_split": os.path.abspath(FLAGS.train_split), "test_split": os.path.abspath(FLAGS.test_split),
        "train_images": train.num_images, "train_captions": train.num_captions,
        "train_images_without_captions": train_missing,
        "test_images": test.num_images, "test_captions": test.num_captions,
        "test_images_without_captions": test_missing,
        "word_vectors": word_vector_source, "word_vector_seconds": round(word_vector_seconds, 1),
        "results": results,
        "random_baseline": {"R@1": chance["s2s_r1"], "R@5": chance["s2s_r5"], "R@10": chance["s2s_r10"],
                            "medr": chance["s2s_medr"]},
    }
    print(format_table(output))
    if FLAGS.out_json:
        write_json(FLAGS.out_json, output)   # atomic; creates the folder
        print(f"results: {FLAGS.out_json}\nNext: python -m experiments.retrieval_table "
              "(the learned embeddings' sentence-to-sentence retrieval, the same protocol)")
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


main = absl_main(run)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
