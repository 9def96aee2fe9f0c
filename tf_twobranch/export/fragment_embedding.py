"""SavedModel export of a deep-fragment-embedding model (Karpathy, Joulin & Fei-Fei, NIPS 2014).

Signatures (inputs validated in the graph, see `tf_twobranch.export.serving`):

* ``embed_image_fragments(image_fragments: float32[batch, fragments, image_dim])``
  → ``image_fragment_embedding`` (batch, fragments, h): v = W_m·CNN + b_m (§3.2).
* ``embed_sentence_fragments(relation, word1, word2: int32[batch, F])``
  → ``sentence_fragment_embedding`` (batch, F, h): s = ReLU(W_R [W_e w1; W_e w2] + b_R)
  (eq. 1). Ids index the relation list and the rows of W_e.
* ``embed_sentence_fragment_strings(relation, word1, word2: string[batch, F])``
  → ``sentence_fragment_embedding``: the same from names. Relation names
  match exactly; words are stripped and lower-cased (as
  `tf_twobranch.data.sentence_fragments` lower-cases them) before the
  look-up. A fragment whose three strings are all empty (or whitespace) is
  padding and embeds to zeros.
* ``score(image_fragments, image_mask: bool[Bi, M], relation, word1, word2, sentence_mask: bool[Bs, F])``
  → ``scores`` (Bi, Bs): S_kl of eq. 6 with the model's ``smoothing``,
  ``normaliser`` and ``global_score`` (`tf_twobranch.losses.fragment.global_scores`).
* ``alignment(...the inputs of score...)`` → ``fragment_scores`` (Bi, M, Bs, F):
  vᵢᵀsⱼ, 0 where either fragment is padding (the alignment matrices of the
  paper's Figs. 4–5).
* ``serving_default`` = ``score``.

Padded fragments (mask False) are ignored: their features and ids may be
anything (e.g. id -1), they are not validated and never reach a score.

Bad requests fail with ``InvalidArgumentError`` naming the input and what was
expected: wrong rank or feature size, mismatched shapes, an empty batch,
NaN/inf features, an id out of range, an unknown relation name or word (the
message shows the value and its [row, column]).

Inside the SavedModel: the relation names in id order (variable
``relations``), the vocabulary in W_e row order (variable ``words``), their
look-up tables, and the model configuration JSON (variable ``config_json``);
``assets.extra`` holds ``run_config.json`` and the TF Serving warm-up file.
No tensorflow-text op is used: plain ``saved_model_cli`` and TF Serving load it.
"""
from __future__ import annotations

import collections
import json
import pathlib
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.export import serving
from tf_twobranch.export.saved_model import save_module_atomically
from tf_twobranch.losses import fragment as fragment_losses
from tf_twobranch.models.fragment_embedding import FragmentEmbeddingModel

__all__ = ["FragmentServingModule", "export_fragment_model"]

ID_INPUTS = ("relation", "word1", "word2")


def _check_names(names: Sequence[str], what: str, expected_count: int, config_field: str) -> list[str]:
    names = list(names)
    if len(names) != expected_count:
        raise ConfigError(f"{what}: got {len(names)} names but the model's {config_field} is {expected_count}")
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{what}: entry {index} must be a non-empty string, got {name!r}")
    duplicates = [name for name, count in collections.Counter(names).items() if count > 1]
    if duplicates:
        raise ConfigError(f"{what}: names must be unique; repeated: {duplicates[:5]}")
    return names


def _lookup_table(keys: Sequence[str]) -> tf.lookup.StaticHashTable:
    # Keys as graph constants: the table is restored with the SavedModel's own
    # init op, by tf.saved_model.load, saved_model_cli and TF Serving alike.
    return tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(list(keys), tf.string),
                                            tf.range(len(keys), dtype=tf.int32)),
        default_value=-1)


def _first_index(condition):
    """[row, column] of the first True of a (B, F) bool tensor ([0, 0] when none)."""
    flat = tf.argmax(tf.cast(tf.reshape(condition, [-1]), tf.int32), output_type=tf.int32)
    columns = tf.maximum(tf.shape(condition)[1], 1)
    return tf.stack([flat // columns, flat % columns])


def _rank2_like(t, reference):
    """`t` reshaped to the (checked) (B, F) shape of `reference`, with a static rank of 2."""
    shape = tf.shape(reference)
    return tf.reshape(t, tf.stack([shape[0], shape[1]]))


def _leading_shape(t):
    """The first two dimensions of `t`'s shape, -1 for those it lacks (safe to compare at any rank)."""
    return tf.concat([tf.shape(t), [-1, -1]], axis=0)[:2]


def _assert(condition, data):
    # Only int32 and string data: tf.debugging.Assert then needs no tf.cond guard,
    # which keeps tracing (paid again when saving) fast.
    return tf.debugging.Assert(condition, data, summarize=8)


class FragmentServingModule(tf.Module):
    """The fragment model's two encoders and its scores behind validated signatures."""

    def __init__(self, model: FragmentEmbeddingModel, relations: Sequence[str], words: Sequence[str]):
        super().__init__(name="fragment_embedding_serving")
        cfg = model.config
        self.relation_names = _check_names(relations, "relations", cfg.num_relations, "num_relations")
        self.word_names = _check_names(words, "words", cfg.vocabulary_size, "vocabulary_size")
        self.image_dim = int(cfg.image_dim)
        self.embed_dim = int(cfg.embed_dim)
        self.score_options = cfg.score_options()
        self.config_json = tf.Variable(json.dumps(cfg.to_dict(), sort_keys=True), trainable=False,
                                       name="model_config")
        self.relations = tf.Variable(self.relation_names, trainable=False, dtype=tf.string, name="relations")
        self.words = tf.Variable(self.word_names, trainable=False, dtype=tf.string, name="words")
        self.relation_table = _lookup_table(self.relation_names)
        self.word_table = _lookup_table(self.word_names)
        if cfg.representation != "fragments":
            raise ConfigError(f"only the fragment representation is exported, got {cfg.representation!r}")
        # The CNN's top layer, when the row fine-tuned it (its input is then
        # the activation below that layer).
        self.image_head = model.image_head
        self.image_projection = model.image_projection
        self.sentence_encoder = model.sentence_encoder
        serving.track_keras_variables(self, *[layer for layer in (self.image_head, self.image_projection,
                                                                  self.sentence_encoder) if layer is not None])

        image_spec = serving.feature_batch_spec("image_fragments")
        id_specs = [tf.TensorSpec(None, tf.int32, name=name) for name in ID_INPUTS]
        string_specs = [tf.TensorSpec(None, tf.string, name=name) for name in ID_INPUTS]
        pair_specs = [image_spec, tf.TensorSpec(None, tf.bool, name="image_mask"), *id_specs,
                      tf.TensorSpec(None, tf.bool, name="sentence_mask")]

        # autograph off: the Python loops below only build per-input checks (no
        # tensor-dependent control flow), and every trace is paid twice (warm-up, save).
        @tf.function(input_signature=[image_spec], autograph=False)
        def embed_image_fragments(image_fragments):
            v = self._image(self._finite_where(self._validate_image_fragments(image_fragments), None))
            return {"image_fragment_embedding": v}

        @tf.function(input_signature=id_specs, autograph=False)
        def embed_sentence_fragments(relation, word1, word2):
            (relation, word1, word2), _ = self._validate_ids(relation, word1, word2)
            return {"sentence_fragment_embedding": self._sentence(relation, word1, word2)}

        @tf.function(input_signature=string_specs, autograph=False)
        def embed_sentence_fragment_strings(relation, word1, word2):
            relation, word1, word2, mask = self._look_up_strings(relation, word1, word2)
            s = self._sentence(relation, word1, word2)
            return {"sentence_fragment_embedding": s * tf.cast(mask, s.dtype)[:, :, None]}

        @tf.function(input_signature=pair_specs, autograph=False)
        def score(image_fragments, image_mask, relation, word1, word2, sentence_mask):
            v, image_mask, s, sentence_mask = self._pair(image_fragments, image_mask, relation, word1, word2,
                                                         sentence_mask)
            return {"scores": fragment_losses.global_scores(v, image_mask, s, sentence_mask,
                                                            **self.score_options)}

        @tf.function(input_signature=pair_specs, autograph=False)
        def alignment(image_fragments, image_mask, relation, word1, word2, sentence_mask):
            v, image_mask, s, sentence_mask = self._pair(image_fragments, image_mask, relation, word1, word2,
                                                         sentence_mask)
            scores = fragment_losses.fragment_scores(v, s)
            valid = image_mask[:, :, None, None] & sentence_mask[None, None, :, :]
            return {"fragment_scores": tf.where(valid, scores, tf.zeros_like(scores))}

        self.embed_image_fragments = embed_image_fragments
        self.embed_sentence_fragments = embed_sentence_fragments
        self.embed_sentence_fragment_strings = embed_sentence_fragment_strings
        self.score = score
        self.alignment = alignment

    def signatures(self) -> dict:
        return {"serving_default": self.score, "score": self.score, "alignment": self.alignment,
                "embed_image_fragments": self.embed_image_fragments,
                "embed_sentence_fragments": self.embed_sentence_fragments,
                "embed_sentence_fragment_strings": self.embed_sentence_fragment_strings}

    # ------------------------------------------------------------------ encoders
    def _image(self, image_fragments):
        if self.image_head is not None:
            image_fragments = self.image_head(image_fragments, training=False)
        v = tf.cast(self.image_projection(image_fragments, training=False), tf.float32)
        v.set_shape([None, None, self.embed_dim])
        return v

    def _sentence(self, relation, word1, word2):
        s = tf.cast(self.sentence_encoder(relation, word1, word2, training=False), tf.float32)
        s.set_shape([None, None, self.embed_dim])
        return s

    # ------------------------------------------------------------------ validation
    def _validate_image_fragments(self, x):
        """(B, M, image_dim) float32 with B >= 1 (finiteness: `_finite_where`)."""
        name, expected = "image_fragments", f"(batch, fragments, {self.image_dim})"
        x = tf.convert_to_tensor(x, tf.float32)
        rank_check = _assert(tf.equal(tf.rank(x), 3),
                             [f"{name} must have shape {expected}; got shape", tf.shape(x)])
        with tf.control_dependencies([rank_check]):
            checks = [
                _assert(tf.equal(tf.shape(x)[-1], self.image_dim),
                        [f"{name} must have shape {expected}; got shape", tf.shape(x)]),
                _assert(tf.shape(x)[0] > 0, [f"{name} is empty; expected shape {expected} with batch >= 1"]),
            ]
        with tf.control_dependencies(checks):
            x = tf.reshape(x, tf.stack([tf.shape(x)[0], tf.shape(x)[1], self.image_dim]))
        x.set_shape([None, None, self.image_dim])
        return x

    def _finite_where(self, x, mask):
        """`x` after checking its fragments are finite where `mask` (all: None); padded ones zeroed."""
        finite = tf.reduce_all(tf.math.is_finite(x), axis=2)
        bad = tf.logical_not(finite) if mask is None else tf.logical_not(finite) & mask
        check = _assert(tf.logical_not(tf.reduce_any(bad)),
                        ["image_fragments contains NaN or inf values; first bad [image, fragment]:",
                         _first_index(bad)])
        with tf.control_dependencies([check]):
            if mask is not None:
                # Padded fragments may hold anything; zeros keep NaNs out of the products.
                x = tf.where(mask[:, :, None], x, tf.zeros_like(x))
            x = tf.identity(x)
        x.set_shape([None, None, self.image_dim])
        return x

    @staticmethod
    def _validate_mask(mask, name, like, like_name):
        """A (B, F) bool mask with the shape of the first two dimensions of the (validated) `like`."""
        mask = tf.convert_to_tensor(mask, tf.bool)
        check = _assert(tf.logical_and(tf.equal(tf.rank(mask), 2),
                                       tf.reduce_all(tf.equal(_leading_shape(mask), _leading_shape(like)))),
                        [f"{name} must have the shape of the first two dimensions of {like_name},",
                         _leading_shape(like), "; got shape", tf.shape(mask)])
        with tf.control_dependencies([check]):
            mask = _rank2_like(mask, like)
        return mask

    @staticmethod
    def _same_shape_checks(tensors, expected: str):
        """Rank 2 and batch >= 1 for the first of `tensors`, the same shape for the others."""
        first = tensors[0]
        checks = [_assert(tf.equal(tf.rank(first), 2),
                          [f"{ID_INPUTS[0]} must have shape {expected}; got shape", tf.shape(first)])]
        with tf.control_dependencies(checks):
            checks.append(_assert(tf.shape(first)[0] > 0,
                                  [f"{ID_INPUTS[0]} is empty; expected shape {expected} with batch >= 1"]))
        for name, t in zip(ID_INPUTS[1:], tensors[1:]):
            checks.append(_assert(
                tf.logical_and(tf.equal(tf.rank(t), 2),
                               tf.reduce_all(tf.equal(_leading_shape(t), _leading_shape(first)))),
                [f"{name} must have the shape of {ID_INPUTS[0]},", tf.shape(first), "; got shape", tf.shape(t)]))
        return checks

    def _validate_ids(self, relation, word1, word2, mask=None, mask_name="sentence_mask"):
        """(B, F) int32 ids in range where `mask` (default: everywhere), with the validated
        mask; padded ids become 0."""
        ids = [tf.convert_to_tensor(t, tf.int32) for t in (relation, word1, word2)]
        checks = self._same_shape_checks(ids, "(batch, fragments) of int32 ids")
        with tf.control_dependencies(checks):
            ids = [_rank2_like(t, ids[0]) for t in ids]
            if mask is not None:
                mask = self._validate_mask(mask, mask_name, ids[0], ID_INPUTS[0])
        relation_limit, word_limit = len(self.relation_names), len(self.word_names)
        for name, t, limit, what in zip(
                ID_INPUTS, ids, [relation_limit, word_limit, word_limit],
                ["relation ids (the model's relation list)",
                 "word ids (the rows of the word-vector matrix W_e)",
                 "word ids (the rows of the word-vector matrix W_e)"]):
            bad = (t < 0) | (t >= limit)
            if mask is not None:
                bad = bad & mask
            checks.append(_assert(tf.logical_not(tf.reduce_any(bad)),
                                  [f"{name} must hold {what} in [0, {limit}); got", tf.boolean_mask(t, bad)[:1],
                                   "at [row, column]", _first_index(bad)]))
        with tf.control_dependencies(checks):
            if mask is not None:
                ids = [tf.where(mask, t, tf.zeros_like(t)) for t in ids]
            ids = [tf.identity(t) for t in ids]
        for t in ids:
            t.set_shape([None, None])
        return ids, mask

    def _look_up_strings(self, relation, word1, word2):
        """Ids of the names, and the mask of the non-padding fragments."""
        strings = [tf.convert_to_tensor(t, tf.string) for t in (relation, word1, word2)]
        checks = self._same_shape_checks(strings, "(batch, fragments) of strings")
        with tf.control_dependencies(checks):
            strings = [tf.strings.strip(_rank2_like(t, strings[0])) for t in strings]
        for name, t in zip(ID_INPUTS, strings):
            # Invalid UTF-8 comes back changed from a lenient transcode (as in serving.validate_strings).
            not_utf8 = tf.not_equal(tf.strings.unicode_transcode(t, "UTF-8", "UTF-8", errors="replace"), t)
            checks.append(_assert(tf.logical_not(tf.reduce_any(not_utf8)),
                                  [f"{name} must be UTF-8 text; got bytes that are not valid UTF-8 at [row, column]",
                                   _first_index(not_utf8)]))
        with tf.control_dependencies(checks):
            strings[1:] = [tf.strings.lower(t, encoding="utf-8") for t in strings[1:]]
        empty = [tf.equal(t, "") for t in strings]
        mask = tf.logical_not(empty[0] & empty[1] & empty[2])
        partial = mask & (empty[0] | empty[1] | empty[2])
        checks.append(_assert(tf.logical_not(tf.reduce_any(partial)),
                              ["a fragment is padding only when relation, word1 and word2 are all empty; got a "
                               "fragment with only some of them empty at [row, column]", _first_index(partial)]))
        more = ", ..." if len(self.relation_names) > 20 else ""
        relation_help = f"one of the model's relations ({', '.join(self.relation_names[:20])}{more})"
        word_help = "a word of the model's vocabulary (words are lower-cased)"
        ids = []
        for index, (name, table, expected) in enumerate(zip(
                ID_INPUTS, [self.relation_table, self.word_table, self.word_table],
                [relation_help, word_help, word_help])):
            found = table.lookup(strings[index])
            unknown = mask & ~empty[index] & (found < 0)
            checks.append(_assert(tf.logical_not(tf.reduce_any(unknown)),
                                  [f"{name}: unknown value", tf.boolean_mask(strings[index], unknown)[:1],
                                   "at [row, column]", _first_index(unknown),
                                   f"; expected {expected}, or an empty string for padding"]))
            ids.append(found)
        with tf.control_dependencies(checks):
            ids = [tf.where(mask, t, tf.zeros_like(t)) for t in ids]
            mask = tf.identity(mask)
        for t in (*ids, mask):
            t.set_shape([None, None])
        return (*ids, mask)

    def _pair(self, image_fragments, image_mask, relation, word1, word2, sentence_mask):
        """Validated, padding-neutral embeddings and masks of a score / alignment request."""
        image_fragments = self._validate_image_fragments(image_fragments)
        image_mask = self._validate_mask(image_mask, "image_mask", image_fragments, "image_fragments")
        image_fragments = self._finite_where(image_fragments, image_mask)
        ids, sentence_mask = self._validate_ids(relation, word1, word2, sentence_mask)
        return self._image(image_fragments), image_mask, self._sentence(*ids), sentence_mask

    # ------------------------------------------------------------------ warm-up
    def warmup_requests(self) -> list[tuple[str, dict]]:
        """One small valid request per signature (two images, two sentences, one padded fragment each)."""
        images = np.zeros((2, 2, self.image_dim), np.float32)
        image_mask = np.array([[True, True], [True, False]])
        ids = {name: np.zeros((2, 2), np.int32) for name in ID_INPUTS}
        sentence_mask = np.array([[True, True], [True, False]])
        pair = {"image_fragments": images, "image_mask": image_mask, **ids, "sentence_mask": sentence_mask}
        # A word the lower-casing look-up can find (a vocabulary with none gets padding only).
        word = next((w for w in self.word_names if w.strip() == w and w.lower() == w), "")
        relation = self.relation_names[0] if word else ""
        strings = {"relation": [[relation, ""]] * 2, "word1": [[word, ""]] * 2, "word2": [[word, ""]] * 2}
        return [("embed_image_fragments", {"image_fragments": images}), ("embed_sentence_fragments", ids),
                ("embed_sentence_fragment_strings", strings), ("score", pair), ("alignment", pair),
                ("serving_default", pair)]


def export_fragment_model(model: FragmentEmbeddingModel, export_dir, *, relations: Sequence[str],
                          words: Sequence[str], run_config: dict | None = None, overwrite: bool = True,
                          model_name: str = "fragment_embedding") -> pathlib.Path:
    """Writes the serving SavedModel of `model` to `export_dir` (atomically; see the module docstring).

    Args:
      model: a built (trained) `FragmentEmbeddingModel`.
      export_dir: output directory (replaced when `overwrite`).
      relations: the relation names in id order (``num_relations`` of them).
      words: the vocabulary in the row order of the frozen word vectors W_e
        (``vocabulary_size`` of them).
      run_config: written to ``assets.extra/run_config.json`` (default
        ``{"model": model.config}``), with the relations and the serving
        signatures added.
      model_name: ``model_spec.name`` in the warm-up requests.

    The warm-up requests are run before saving and replayed on the reloaded
    SavedModel afterwards; a failure of either raises.

    Raises:
      ConfigError: `relations` or `words` do not fit the model (count,
        empty or repeated names).
      FileExistsError: `export_dir` exists and not `overwrite`.
    """
    if pathlib.Path(export_dir).exists() and not overwrite:
        raise FileExistsError(f"{export_dir} exists")
    module = FragmentServingModule(model, relations, words)
    config = dict(run_config) if run_config else {"model": model.config.to_dict()}
    config["fragment_export"] = {"relations": list(module.relation_names),
                                 "vocabulary_size": len(module.word_names),
                                 "signatures": sorted(module.signatures())}
    path = save_module_atomically(module, export_dir, config, overwrite=overwrite, model_name=model_name)
    # What TF Serving will do on load: replay the warm-up file on the written model.
    serving.replay_warmup_file(path)
    return path
