r"""Extracts sentence features (HGLMM/GMM Fisher vectors, mean word2vec, tf-idf).

Fits a text encoder on the captions of the training images and writes one
feature file per split, in the layout of the two-branch networks' released
data: HDF5, dataset 'text_features', column-major (h5py sees (D, N)), rows in
caption-corpus order (captions of one image adjacent).

Example (the papers' setting: HGLMM FV of word2vec, 30 components, PCA 6000):

  python -m tf_twobranch.tools.extract_text_features \
      --captions=results_20130124.token \
      --train_split=flickr30k_entities/train.txt \
      --splits=flickr30k_entities/val.txt,flickr30k_entities/test.txt \
      --encoder=fisher_hglmm --pca_dim=6000 \
      --word_vectors=GoogleNews-vectors-negative300.bin --out_dir=text_features/

Outputs in --out_dir, for every split file ``<name>.txt``:
  ``<name>_text_features.h5``  features (key 'text_features', column-major)
  ``<name>_captions.tsv``      one line per feature row: image id, caption
plus ``text_encoder.npz`` (the fitted encoder, reload with
`tf_twobranch.features.text_features.load_text_encoder`) and
``text_features_config.json``. Without --word_vectors, count-based vectors
are trained on the training captions (not word2vec) and saved as
``word_vectors.bin``.
"""
from __future__ import annotations

import json
import logging
import os
import time

from absl import app, flags

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.data.formats.features import save_feature_matrix
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.data.formats.splits import read_split_file
from tf_twobranch.data.formats.word_vectors import load_word_vectors, save_word_vectors
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, UserInputError

FLAGS = flags.FLAGS

def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("captions", None, "Caption file in the Flickr30K token layout (<id>.jpg#<k>\\t<caption>).", **d)
    flags.DEFINE_string("train_split", None, "Split file of training image ids; the encoder is fitted on "
                        "their captions.", **d)
    flags.DEFINE_list("splits", [], "Comma-separated split files to extract features for (the training split is "
                      "included automatically unless --noextract_train).", **d)
    flags.DEFINE_bool("extract_train", True, "Also write features for the training split.", **d)
    flags.DEFINE_string("encoder", "fisher_hglmm", "One of fisher_hglmm, fisher_gmm, mean_vector, tfidf.", **d)
    flags.DEFINE_string("word_vectors", None, "Local word2vec (binary/text) or GloVe file. When absent, "
                        "count-based (PPMI-SVD) vectors are trained on the training captions.", **d)
    flags.DEFINE_integer("word_vector_dim", 300, "Dimension of word vectors trained when --word_vectors is "
                         "absent.", **d)
    flags.DEFINE_integer("pca_dim", None, "Fisher vectors only: PCA output size (papers: 6000). Default: no PCA.", **d)
    flags.DEFINE_integer("num_components", 30, "Fisher vectors only: mixture components.", **d)
    flags.DEFINE_integer("max_fit_words", 100_000, "Fisher vectors only: at most this many distinct words fit "
                         "the mixture.", **d)
    flags.DEFINE_integer("pca_max_sentences", 20_000, "Fisher vectors only: sentences used to fit PCA.", **d)
    flags.DEFINE_bool("ica", False, "Fisher vectors only: FastICA on the word vectors before the mixture (slow).", **d)
    flags.DEFINE_integer("tfidf_max_features", 3000, "tf-idf only: dictionary size (papers: 3000 Flickr30K, "
                         "5600 MSCOCO).", **d)
    flags.DEFINE_bool("skip_missing_images", True, "Skip (and count) split images that have no captions in --captions "
                      "instead of failing.", **d)
    flags.DEFINE_integer("seed", 0, "Seed of every random choice.", **d)
    flags.DEFINE_string("out_dir", None, "Output directory (created if needed).", **d)


logger = logging.getLogger("extract_text_features")


def _split_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _select(corpus, split_path: str, skip_missing: bool):
    """The corpus restricted to a split's images; returns (subset, #missing images)."""
    all_ids = read_split_file(split_path)
    known = set(corpus.image_ids)
    present = [i for i in all_ids if i in known]
    missing = len(all_ids) - len(present)
    if missing and not skip_missing:
        first = next(i for i in all_ids if i not in known)
        raise UserInputError(f"{split_path}: {missing} image ids have no captions in {FLAGS.captions} "
                             f"(first: {first!r}); pass --skip_missing_images to skip them")
    if not present:
        raise UserInputError(f"{split_path}: none of its {len(all_ids)} image ids has captions in {FLAGS.captions}")
    return corpus.subset(present, source=split_path), missing


def _check_flags() -> None:
    # The encoders import scikit-learn: only once the flags are parsed, so --help starts fast.
    from tf_twobranch.features.text_features import TEXT_ENCODERS

    for name in ("captions", "train_split", "out_dir"):
        if not getattr(FLAGS, name):
            raise ConfigError(f"--{name} is required")
    for path in [FLAGS.captions, FLAGS.train_split, *FLAGS.splits] + ([FLAGS.word_vectors] if FLAGS.word_vectors else []):
        if not os.path.isfile(path):
            raise ConfigError(f"file not found: {path}")
    if FLAGS.encoder not in TEXT_ENCODERS:
        raise ConfigError(f"--encoder={FLAGS.encoder!r} is unknown; choose one of {', '.join(TEXT_ENCODERS)}")
    if FLAGS.pca_dim is not None and not FLAGS.encoder.startswith("fisher"):
        raise ConfigError(f"--pca_dim only applies to Fisher-vector encoders, not --encoder={FLAGS.encoder}")
    for name in ("pca_dim", "num_components", "max_fit_words", "pca_max_sentences", "tfidf_max_features",
                 "word_vector_dim"):
        value = getattr(FLAGS, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name} must be positive, got {value}")
    names = [_split_name(p) for p in ([FLAGS.train_split] if FLAGS.extract_train else []) + FLAGS.splits]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"split files share the base name(s) {duplicates}; output files would collide")


def run() -> dict:
    """Runs the extraction described by the flags; returns the written config."""
    # The encoders and word-vector training import scikit-learn/scipy: only when the tool runs, so
    # --help starts fast.
    from tf_twobranch.features.text_features import build_text_encoder, encoder_needs_word_vectors
    from tf_twobranch.features.word_vectors import train_word_vectors

    _check_flags()
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    corpus = read_token_file(FLAGS.captions)
    train, train_missing = _select(corpus, FLAGS.train_split, FLAGS.skip_missing_images)
    splits = {}
    if FLAGS.extract_train:
        splits[_split_name(FLAGS.train_split)] = (FLAGS.train_split, train, train_missing)
    for path in FLAGS.splits:
        subset, missing = _select(corpus, path, FLAGS.skip_missing_images)
        splits[_split_name(path)] = (path, subset, missing)
    train_tokens = [tokenize_caption(c) for c in train.captions]
    split_tokens = {name: [tokenize_caption(c) for c in subset.captions] for name, (_, subset, _) in splits.items()}
    logger.info("Training split %s: %d images, %d captions (%d images without captions skipped)",
                FLAGS.train_split, train.num_images, train.num_captions, train_missing)

    kwargs = {}
    word_vector_source = None
    if encoder_needs_word_vectors(FLAGS.encoder):
        if FLAGS.word_vectors:
            vocabulary = {t for tokens in train_tokens for t in tokens}
            for tokens in split_tokens.values():
                vocabulary.update(t for s in tokens for t in s)
            word_vectors = load_word_vectors(FLAGS.word_vectors, vocabulary=vocabulary)
            covered = sum(t in word_vectors for s in train_tokens for t in s)
            total = max(1, sum(len(s) for s in train_tokens))
            logger.info("Loaded %d of %d caption words from %s; they cover %.1f%% of training tokens",
                        len(word_vectors), len(vocabulary), FLAGS.word_vectors, 100.0 * covered / total)
            if len(word_vectors) == 0:
                raise UserInputError(f"{FLAGS.word_vectors}: none of the caption words has a vector "
                                     "(is the file lower-cased like the tokenizer's output?)")
            word_vector_source = os.path.abspath(FLAGS.word_vectors)
        else:
            logger.warning(
                "No --word_vectors given: training %d-d count-based word vectors (PPMI + truncated SVD) on the "
                "%d training captions. These are NOT word2vec; results will differ from the papers, which use "
                "GoogleNews word2vec. Pass --word_vectors=<local file> to use pretrained vectors.",
                FLAGS.word_vector_dim, len(train_tokens))
            word_vectors = train_word_vectors(train_tokens, dim=FLAGS.word_vector_dim, seed=FLAGS.seed)
            trained_path = os.path.join(FLAGS.out_dir, "word_vectors.bin")
            save_word_vectors(trained_path, word_vectors, binary=True)
            word_vector_source = f"trained PPMI-SVD on training captions ({trained_path})"
        kwargs["word_vectors"] = word_vectors
    if FLAGS.encoder.startswith("fisher"):
        kwargs.update(num_components=FLAGS.num_components, pca_dim=FLAGS.pca_dim, seed=FLAGS.seed,
                      max_fit_words=FLAGS.max_fit_words, pca_max_sentences=FLAGS.pca_max_sentences, ica=FLAGS.ica)
    elif FLAGS.encoder == "tfidf":
        kwargs.update(max_features=FLAGS.tfidf_max_features)

    encoder = build_text_encoder(FLAGS.encoder, **kwargs)
    start = time.time()
    encoder.fit(train_tokens)
    logger.info("Fitted %s in %.1f s; output dimension %d", FLAGS.encoder, time.time() - start, encoder.output_dim)
    encoder_path = os.path.join(FLAGS.out_dir, "text_encoder.npz")
    encoder.save(encoder_path)

    outputs = {}
    for name, (path, subset, missing) in splits.items():
        features = encoder.transform(split_tokens[name])
        feature_path = os.path.join(FLAGS.out_dir, f"{name}_text_features.h5")
        save_feature_matrix(feature_path, features, key="text_features", layout="columns")
        index_path = os.path.join(FLAGS.out_dir, f"{name}_captions.tsv")
        with open(index_path, "w", encoding="utf-8") as out:
            for caption, image in zip(subset.captions, subset.caption_image):
                out.write(f"{subset.image_ids[image]}\t{caption}\n")
        outputs[name] = {"split_file": os.path.abspath(path), "features": feature_path, "captions": index_path,
                         "num_images": subset.num_images, "num_captions": subset.num_captions,
                         "images_without_captions": missing}
        logger.info("%s: wrote %s (%d x %d; %d images without captions skipped)", name, feature_path,
                    features.shape[0], features.shape[1], missing)

    config = {"encoder": encoder.get_config(), "captions": os.path.abspath(FLAGS.captions),
              "train_split": os.path.abspath(FLAGS.train_split), "word_vectors": word_vector_source,
              "encoder_file": encoder_path, "layout": "HDF5 'text_features', column-major (D, N)",
              "splits": outputs}
    with open(os.path.join(FLAGS.out_dir, "text_features_config.json"), "w", encoding="utf-8") as out:
        json.dump(config, out, indent=2)
    return config


def _run_with_logging():
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run()


main = absl_main(_run_with_logging)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
