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
  `tf_twobranch.systems.fragments.sentence_fragments` lower-cases them) before the
  look-up. A fragment whose three strings are all empty (or whitespace) is
  padding and embeds to zeros. Strict: an unknown relation or word is an error.
* ``embed_sentences(relation, word1, word2: string[batch, F])`` → ``sentence_fragment_embedding``
  (batch, F, h) and ``sentence_mask`` bool (batch, F): the (relation,
  governor, dependent) triplets of a dependency parse as the training data
  takes them (`tf_twobranch.systems.fragments.sentence_fragments.encode_fragments`): a
  fragment whose relation is not among the model's relations (dropped in
  training as rarer than 1 %) or with a word outside its vocabulary is
  DROPPED (mask False, embedding zero), so a parser's whole output can be
  sent. A sentence left with no fragment is an error naming its row.
  **The parse itself cannot run in the SavedModel** (a dependency parser is
  a statistical model of its own, spaCy, CoreNLP, Stanza, not TensorFlow
  ops): the client parses, e.g. with spaCy (`tf_twobranch.data.spacy_parses`,
  the ``[parse]`` extra) and `tree_triplets` with the run's ``--fragments``
  and ``--collapse_prepositions``; `triplet_request` pads the triplets into
  these three inputs (docs/SERVING.md has the recipe).
* ``score(image_fragments, image_mask: bool[Bi, M], relation, word1, word2, sentence_mask: bool[Bs, F])``
  → ``scores`` (Bi, Bs): S_kl of eq. 6 with the model's ``smoothing``,
  ``normaliser`` and ``global_score`` (`tf_twobranch.systems.fragments.losses.global_scores`).
* ``alignment(...the inputs of score...)`` → ``fragment_scores`` (Bi, M, Bs, F):
  vᵢᵀsⱼ, 0 where either fragment is padding (the alignment matrices of the
  paper's Figs. 4–5).
* ``serving_default`` = ``score``.

Exported with the CNN (``image_cnn=``, `tf_twobranch.systems.fragments.features.fragment_cnn`),
the image fragments are computed in the graph from the image files:

* ``embed_images(image_jpeg: string[B], boxes: float32[B, M, 4], num_boxes: int32[B])``
  → ``image_fragment_embedding`` (B, 1 + M, h) and ``image_mask`` (B, 1 + M):
  fragment 0 is the whole image, fragments 1..num_boxes[b] image b's boxes
  ``boxes[b, :num_boxes[b]]`` (the detector's top boxes, best first; the
  offline cache takes the top ``detections`` = 19), rows beyond
  ``num_boxes[b]`` padding (any values; the mask is False there, the
  embedding zero). Boxes are ``[x1, y1, x2, y2]`` inclusive pixels of the
  original image (the package's box convention, that of proposal files):
  ``0 <= x1 <= x2 <= width - 1`` and likewise for y; fractional coordinates
  are widened to whole pixels. Exactly the offline features
  (`tf_twobranch.systems.fragments.image_fragments.extract_fragment_features`): JPEGs
  decoded as PIL decodes them, each box cropped and resized to the CNN input
  S×S with `tf_twobranch.features.images.tf_pil_resize` (PIL's bilinear
  resize, bit for bit), then the CNN (with the scene CNN's folded top layer
  unless the row fine-tuned it).
* ``score_jpeg(image_jpeg, boxes, num_boxes, relation, word1, word2)`` →
  ``scores`` (Bi, Bs): S_kl of those image fragments and the parse triplets
  of ``embed_sentences``.

Exported with a gallery (``gallery=``, `fragment_gallery` /
`tf_twobranch.run_export.gallery_from_model`): ``retrieve_captions``
(the image input: ``image_jpeg``, ``boxes``, ``num_boxes`` with the CNN,
else ``image_fragments``, ``image_mask``; and ``k``) and ``retrieve_images``
(the parse triplets of ``embed_sentences`` and ``k``) → the top-k gallery
ids, indices and S_kl scores (`tf_twobranch.export.retrieval_signatures`). The gallery
holds each gallery image's fragment embeddings and each gallery caption's
sentence-fragment embeddings with their masks, embedded as
``model.evaluate`` embeds them, and S_kl is the one ``evaluate`` ranks by.

Padded fragments (mask False) are ignored: their features and ids may be
anything (e.g. id -1), they are not validated and never reach a score.

Bad requests fail with ``InvalidArgumentError`` naming the input and what was
expected: wrong rank or feature size, mismatched shapes, an empty batch,
NaN/inf features, an id out of range, an unknown relation name or word (the
message shows the value and its [row, column]), bytes that are not an image
(the element index), a box outside its image or empty ([image, box]), a
box count outside 0..M. The new signatures declare their fixed sizes
(``boxes`` (None, None, 4), ``image_fragments`` (None, None, image_dim)).

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

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.export.run_gallery import RunExport, batched, caption_keys, gallery_caption_ids, plain_captions
from tf_twobranch.export import serving
from tf_twobranch.export.retrieval_signatures import RetrievalGallery, add_retrieval_signatures, padded_rows
from tf_twobranch.export.saved_model import save_module_atomically, warmup_jpeg
from tf_twobranch.features.backbones import backbone_input_size
from tf_twobranch.features.images import tf_pil_resize
from tf_twobranch.systems.fragments import losses as fragment_losses
from tf_twobranch.models.evaluation_input import as_evaluation_split
from tf_twobranch.systems.fragments.model import FragmentEmbeddingModel

__all__ = ["FragmentServingModule", "export_fragment_model", "fragment_gallery", "triplet_request", "run_export"]

ID_INPUTS = ("relation", "word1", "word2")
# Scores per query row of one gallery block (fragment pairs): bounds a retrieval request's memory.
BLOCK_PAIRS = 2 ** 22
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
    """[row, column] of the first True of a (B, F) bool tensor ([0, 0] when none, also when it is empty)."""
    # A trailing False keeps the arg-max defined for an empty tensor (e.g. (B, 0) boxes).
    flat = tf.argmax(tf.concat([tf.cast(tf.reshape(condition, [-1]), tf.int32), [0]], axis=0),
                     output_type=tf.int32)
    columns = tf.maximum(tf.shape(condition)[1], 1)
    return tf.stack([flat // columns, flat % columns])


def _first_true(condition):
    """Index of the first True of a (B,) bool tensor (0 when none, also when it is empty)."""
    return tf.argmax(tf.concat([tf.cast(condition, tf.int32), [0]], axis=0), output_type=tf.int32)


def _last_dim(t):
    """The last dimension of `t`'s shape as fed, -1 for a scalar (safe to compare at any rank)."""
    return tf.concat([[-1], serving.fed_shape(t)], axis=0)[-1]


def _rank2_like(t, reference):
    """`t` reshaped to the (checked) (B, F) shape of `reference`, with a static rank of 2.

    Called inside the checks' control dependencies: the fed shape (`serving.fed_shape`) carries
    them to the reshape as data, which Grappler cannot drop as redundant."""
    shape = serving.fed_shape(reference)
    out = tf.reshape(t, tf.stack([shape[0], shape[1]]))
    out.set_shape([None, None])
    return out


def _leading_shape(t):
    """The first two dimensions of `t`'s shape as fed, -1 for those it lacks (safe to compare at any rank)."""
    return tf.concat([serving.fed_shape(t), [-1, -1]], axis=0)[:2]


def _assert(condition, data):
    # Only int32 and string data: tf.debugging.Assert then needs no tf.cond guard,
    # which keeps tracing (paid again when saving) fast.
    return tf.debugging.Assert(condition, data, summarize=8)


class FragmentServingModule(tf.Module):
    """The fragment model's two encoders and its scores behind validated signatures."""

    def __init__(self, model: FragmentEmbeddingModel, relations: Sequence[str], words: Sequence[str], *,
                 image_cnn: keras.Model | None = None, gallery: RetrievalGallery | None = None,
                 gallery_block: int | None = None):
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

        # Declared sizes; the graph's checks stay for callers that bypass the specs (a concrete
        # function called on a tensor of another shape) and name what the request got.
        image_spec = tf.TensorSpec([None, None, self.image_dim], tf.float32, name="image_fragments")
        id_specs = [tf.TensorSpec([None, None], tf.int32, name=name) for name in ID_INPUTS]
        string_specs = [tf.TensorSpec([None, None], tf.string, name=name) for name in ID_INPUTS]
        image_mask_spec = tf.TensorSpec([None, None], tf.bool, name="image_mask")
        pair_specs = [image_spec, image_mask_spec, *id_specs, tf.TensorSpec([None, None], tf.bool, name="sentence_mask")]

        @serving.signature_function(image_spec)
        def embed_image_fragments(image_fragments):
            v = self._image(self._finite_where(self._validate_image_fragments(image_fragments), None))
            return {"image_fragment_embedding": v}

        @serving.signature_function(*id_specs)
        def embed_sentence_fragments(relation, word1, word2):
            (relation, word1, word2), _ = self._validate_ids(relation, word1, word2)
            return {"sentence_fragment_embedding": self._sentence(relation, word1, word2)}

        @serving.signature_function(*string_specs)
        def embed_sentence_fragment_strings(relation, word1, word2):
            relation, word1, word2, mask = self._look_up_strings(relation, word1, word2)
            s = self._sentence(relation, word1, word2)
            return {"sentence_fragment_embedding": s * tf.cast(mask, s.dtype)[:, :, None]}

        @serving.signature_function(*pair_specs)
        def score(image_fragments, image_mask, relation, word1, word2, sentence_mask):
            v, image_mask, s, sentence_mask = self._pair(image_fragments, image_mask, relation, word1, word2,
                                                         sentence_mask)
            return {"scores": fragment_losses.global_scores(v, image_mask, s, sentence_mask,
                                                            **self.score_options)}

        @serving.signature_function(*pair_specs)
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

        # Parse triplets as the training data takes them: unknown fragments dropped.
        triplet_specs = [tf.TensorSpec([None, None], tf.string, name=name) for name in ID_INPUTS]

        @serving.signature_function(*triplet_specs)
        def embed_sentences(relation, word1, word2):
            s, mask = self._parsed_sentences(relation, word1, word2)
            return {"sentence_fragment_embedding": s, "sentence_mask": mask}

        self.embed_sentences = embed_sentences
        self.image_cnn = image_cnn
        if image_cnn is not None:
            cnn_dim = int(image_cnn.output.shape[-1])
            if cnn_dim != self.image_dim:
                raise ConfigError(f"image_cnn outputs {cnn_dim} features but the model's image_dim is "
                                  f"{self.image_dim} (features.prepare_fragments.fragment_cnn builds the CNN "
                                  "of the run's image inputs)")
            self.image_size = backbone_input_size(image_cnn)
            serving.track_keras_variables(self, image_cnn)
            jpeg_specs = [tf.TensorSpec([None], tf.string, name="image_jpeg"),
                          tf.TensorSpec([None, None, 4], tf.float32, name="boxes"),
                          tf.TensorSpec([None], tf.int32, name="num_boxes")]

            @serving.signature_function(*jpeg_specs)
            def embed_images(image_jpeg, boxes, num_boxes):
                v, mask = self._jpeg_images(image_jpeg, boxes, num_boxes)
                return {"image_fragment_embedding": v, "image_mask": mask}

            @serving.signature_function(*jpeg_specs, *triplet_specs)
            def score_jpeg(image_jpeg, boxes, num_boxes, relation, word1, word2):
                v, image_mask = self._jpeg_images(image_jpeg, boxes, num_boxes)
                s, sentence_mask = self._parsed_sentences(relation, word1, word2)
                return {"scores": fragment_losses.global_scores(v, image_mask, s, sentence_mask,
                                                                **self.score_options)}

            self.embed_images = embed_images
            self.score_jpeg = score_jpeg
        if image_cnn is not None:
            image_specs, embed_image = jpeg_specs, self._jpeg_images
        else:
            image_specs, embed_image = [image_spec, image_mask_spec], self._image_side
        self.query_specs = (image_specs, triplet_specs)
        self._query_image = embed_image
        self.has_gallery = gallery is not None
        if gallery is not None:
            if gallery.image_mask is None or gallery.caption_mask is None:
                raise ConfigError("a fragment gallery holds the masks of its image and sentence fragments "
                                  "(fragment_gallery builds it)")
            if gallery_block is None:
                slots = int(np.shape(gallery.image_embeddings)[1]) * int(np.shape(gallery.caption_embeddings)[1])
                gallery_block = max(1, BLOCK_PAIRS // max(1, slots))
            add_retrieval_signatures(
                self, gallery, image_spec=image_specs, text_spec=triplet_specs, embed_image=embed_image,
                embed_text=self._parsed_sentences, block_rows=gallery_block,
                pair_scores=lambda images, texts: fragment_losses.global_scores(*images, *texts,
                                                                                **self.score_options))

    def signatures(self) -> dict:
        out = {"serving_default": self.score, "score": self.score, "alignment": self.alignment,
               "embed_image_fragments": self.embed_image_fragments,
               "embed_sentence_fragments": self.embed_sentence_fragments,
               "embed_sentence_fragment_strings": self.embed_sentence_fragment_strings,
               "embed_sentences": self.embed_sentences}
        if self.image_cnn is not None:
            out.update(embed_images=self.embed_images, score_jpeg=self.score_jpeg)
        if self.has_gallery:
            out.update(retrieve_captions=self.retrieve_captions, retrieve_images=self.retrieve_images)
        return out

    def query_image(self, *inputs):
        """(v, mask) of ``retrieve_captions``' query: JPEG bytes and boxes with the CNN, else
        image-fragment features and their mask."""
        return self._query_image(*inputs)

    def query_text(self, relation, word1, word2):
        """(s, mask) of ``retrieve_images``' query: the parse triplets of ``embed_sentences``."""
        return self._parsed_sentences(relation, word1, word2)

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
        shape = serving.fed_shape(x)    # as fed: the declared (None, None, image_dim) folds tf.rank / tf.shape
        rank_ok = tf.equal(tf.size(shape), 3)
        ok = rank_ok & tf.equal(_last_dim(x), self.image_dim)
        checks = [_assert(ok, [f"{name} must have shape {expected}; got shape", shape]),
                  _assert(tf.logical_not(ok) | (serving.fed_dim(shape, 0) > 0),
                          [f"{name} is empty; expected shape {expected} with batch >= 1"])]
        # Another shape reads zeros (of its batch and fragments where it has them): only the checks fail.
        leading = tf.where(rank_ok, tf.concat([shape, [1, 1]], axis=0)[:2], [1, 1])
        x = serving.fed_or_stand_in(x, shape, ok, [None, None, self.image_dim],
                                    lambda: tf.zeros(tf.concat([leading, [self.image_dim]], axis=0)))
        with tf.control_dependencies(checks):
            return tf.identity(x)

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
        check = _assert(tf.logical_and(tf.equal(serving.fed_rank(mask), 2),
                                       tf.reduce_all(tf.equal(_leading_shape(mask), _leading_shape(like)))),
                        [f"{name} must have the shape of the first two dimensions of {like_name},",
                         _leading_shape(like), "; got shape", serving.fed_shape(mask)])
        with tf.control_dependencies([check]):
            mask = _rank2_like(mask, like)
        return mask

    @staticmethod
    def _same_shape_checks(tensors, expected: str):
        """Rank 2 and batch >= 1 for the first of `tensors`, the same shape for the others."""
        first = tensors[0]
        first_shape = serving.fed_shape(first)
        checks = [_assert(tf.equal(tf.size(first_shape), 2),
                          [f"{ID_INPUTS[0]} must have shape {expected}; got shape", first_shape])]
        with tf.control_dependencies(checks):
            checks.append(_assert(first_shape[0] > 0,
                                  [f"{ID_INPUTS[0]} is empty; expected shape {expected} with batch >= 1"]))
        for name, t in zip(ID_INPUTS[1:], tensors[1:]):
            checks.append(_assert(
                tf.logical_and(tf.equal(serving.fed_rank(t), 2),
                               tf.reduce_all(tf.equal(_leading_shape(t), _leading_shape(first)))),
                [f"{name} must have the shape of {ID_INPUTS[0]},", first_shape, "; got shape",
                 serving.fed_shape(t)]))
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

    def _look_up_strings(self, relation, word1, word2, drop_unknown: bool = False):
        """Ids of the names, and the mask of the non-padding fragments.

        `drop_unknown`: a fragment with a relation or word the model does not know is dropped
        (mask False), as `encode_fragments` drops it from the training data, instead of being an
        error; a sentence left with no fragment is an error naming its row.
        """
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
            ids.append(found)
            if drop_unknown:
                continue
            unknown = mask & ~empty[index] & (found < 0)
            checks.append(_assert(tf.logical_not(tf.reduce_any(unknown)),
                                  [f"{name}: unknown value", tf.boolean_mask(strings[index], unknown)[:1],
                                   "at [row, column]", _first_index(unknown),
                                   f"; expected {expected}, or an empty string for padding"]))
        if drop_unknown:
            mask = mask & (ids[0] >= 0) & (ids[1] >= 0) & (ids[2] >= 0)
            no_fragment = tf.logical_not(tf.reduce_any(mask, axis=1))
            checks.append(_assert(tf.logical_not(tf.reduce_any(no_fragment)),
                                  ["a sentence has no fragment the model knows (its relation among the model's "
                                   "relations, both words in its vocabulary; the others are dropped, as in "
                                   "training); first such row:", _first_true(no_fragment)]))
        with tf.control_dependencies(checks):
            ids = [tf.where(mask, t, tf.zeros_like(t)) for t in ids]
            mask = tf.identity(mask)
        for t in (*ids, mask):
            t.set_shape([None, None])
        return (*ids, mask)

    def _parsed_sentences(self, relation, word1, word2):
        """(s (B, F, h), mask (B, F)) of parse triplets, unknown fragments dropped (zero, mask False)."""
        relation, word1, word2, mask = self._look_up_strings(relation, word1, word2, drop_unknown=True)
        s = self._sentence(relation, word1, word2)
        return s * tf.cast(mask, s.dtype)[:, :, None], mask

    def _image_side(self, image_fragments, image_mask):
        """(v (B, M, h), mask (B, M)) of validated CNN features of image fragments."""
        image_fragments = self._validate_image_fragments(image_fragments)
        image_mask = self._validate_mask(image_mask, "image_mask", image_fragments, "image_fragments")
        return self._image(self._finite_where(image_fragments, image_mask)), image_mask

    def _jpeg_images(self, image_jpeg, boxes, num_boxes):
        """(v (B, 1 + M, h), mask (B, 1 + M)): the whole image and its boxes through the CNN (module doc)."""
        features, mask = self._jpeg_fragment_features(image_jpeg, boxes, num_boxes)
        v = self._image(features)
        return tf.where(mask[:, :, None], v, tf.zeros_like(v)), mask

    def _jpeg_fragment_features(self, image_jpeg, boxes, num_boxes):
        """(B, 1 + M, image_dim) CNN features of every image's fragments (zero where masked), and the mask.

        The crops of `tf_twobranch.systems.fragments.image_fragments.extract_fragment_features`:
        fragment 0 the whole image, an inclusive box b cropped as the half-open
        b + [0, 0, 1, 1] widened to whole pixels, resized to S×S by PIL's rule.
        """
        jpeg = tf.convert_to_tensor(image_jpeg, tf.string)
        boxes = tf.convert_to_tensor(boxes, tf.float32)
        num_boxes = tf.convert_to_tensor(num_boxes, tf.int32)
        expected = "(batch, boxes, 4) as [x1, y1, x2, y2]"
        # Shapes as fed (serving.fed_shape): the declared (None, None, 4) / (None,) fold tf.rank and tf.shape.
        boxes_shape, counts_shape = serving.fed_shape(boxes), serving.fed_shape(num_boxes)
        checks = [_assert(tf.logical_and(tf.equal(tf.size(boxes_shape), 3), tf.equal(_last_dim(boxes), 4)),
                          [f"boxes must have shape {expected}; got shape", boxes_shape]),
                  _assert(tf.equal(tf.size(counts_shape), 1),
                          ["num_boxes must have shape (batch,); got shape", counts_shape])]
        # Another shape reads no boxes instead: only the checks above fail.
        images = tf.size(jpeg)
        shapes_ok = (tf.equal(tf.size(boxes_shape), 3) & tf.equal(_last_dim(boxes), 4)
                     & tf.equal(tf.size(counts_shape), 1))
        boxes = serving.fed_or_stand_in(boxes, boxes_shape, shapes_ok, [None, None, 4],
                                        lambda: tf.zeros(tf.stack([images, 0, 4])))
        num_boxes = serving.fed_or_stand_in(num_boxes, counts_shape, shapes_ok, [None],
                                            lambda: tf.zeros([images], tf.int32))
        with tf.control_dependencies(checks):
            checks.append(_assert(
                tf.logical_and(tf.equal(tf.shape(boxes)[0], images), tf.equal(tf.shape(num_boxes)[0], images)),
                ["image_jpeg, boxes and num_boxes must have the same batch size (boxes[b] and num_boxes[b] "
                 "belong to image b); got", images, "images,", tf.shape(boxes)[0], "rows of boxes and",
                 tf.shape(num_boxes)[0], "counts"]))
        with tf.control_dependencies(checks):
            slots = tf.shape(boxes)[1]
            bad_count = (num_boxes < 0) | (num_boxes > slots)
            checks.append(_assert(tf.logical_not(tf.reduce_any(bad_count)),
                                  ["num_boxes[b] must lie in 0..M (M = boxes.shape[1], here", slots,
                                   "); got", tf.boolean_mask(num_boxes, bad_count)[:1], "at index",
                                   _first_true(bad_count)]))
        with tf.control_dependencies(checks):
            given = tf.sequence_mask(num_boxes, slots)
            not_finite = given & tf.logical_not(tf.reduce_all(tf.math.is_finite(boxes), axis=2))
            checks.append(_assert(tf.logical_not(tf.reduce_any(not_finite)),
                                  ["boxes contain NaN or inf coordinates; first bad [image, box]:",
                                   _first_index(not_finite)]))
        with tf.control_dependencies(checks):
            # Padding rows may hold anything: zeros from here on.
            boxes = tf.where(given[:, :, None], boxes, tf.zeros_like(boxes))
            num_boxes = tf.identity(num_boxes)
        size = self.image_size

        def crops_of(image, image_boxes, count):
            height, width = tf.shape(image)[0], tf.shape(image)[1]
            whole = tf.cast(tf.stack([0, 0, width - 1, height - 1]), tf.float32)[None]
            half_open = tf.concat([whole, image_boxes], axis=0) + tf.constant([0.0, 0.0, 1.0, 1.0])
            x1, y1, x2, y2 = tf.unstack(half_open, axis=1)
            used = tf.concat([[True], tf.sequence_mask(count, tf.shape(image_boxes)[0])], axis=0)
            # `validate_boxes`' rule on the half-open box.
            inside = ((x1 < x2) & (y1 < y2) & (x1 >= 0.0) & (y1 >= 0.0)
                      & (x2 <= tf.cast(width, tf.float32)) & (y2 <= tf.cast(height, tf.float32)))
            pixels = tf.cast(tf.concat([tf.floor(half_open[:, :2]), tf.math.ceil(half_open[:, 2:])], axis=1),
                             tf.int32)
            # Padding and bad boxes crop one pixel (never encoded; a bad box is reported below).
            pixels = tf.where((used & inside)[:, None], pixels, tf.constant([[0, 0, 1, 1]], tf.int32))

            def crop(box):
                region = image[box[1]:box[3], box[0]:box[2], :]
                return tf.cast(tf_pil_resize(region, size, size), tf.float32)

            crops = tf.map_fn(crop, pixels, fn_output_signature=tf.TensorSpec([size, size, 3], tf.float32))
            return crops, used & tf.logical_not(inside), tf.stack([height, width])

        crops, bad, image_sizes = serving.map_decoded_images(
            jpeg, "image_jpeg", crops_of,
            [(tf.float32, tf.stack([1 + slots, size, size, 3])), (tf.bool, tf.stack([1 + slots])), (tf.int32, [2])],
            extra=(boxes, num_boxes))
        bad = bad[:, 1:]
        at = _first_index(bad)
        check = _assert(tf.logical_not(tf.reduce_any(bad)),
                        ["boxes: a box is empty or outside its image; expected 0 <= x1 <= x2 <= width-1 and "
                         "0 <= y1 <= y2 <= height-1 (0-based inclusive pixels of the original image); first bad "
                         "[image, box]:", at, "that image's height and width:", tf.gather(image_sizes, at[0])])
        batch = tf.shape(num_boxes)[0]
        mask = tf.concat([tf.ones([batch, 1], tf.bool), tf.sequence_mask(num_boxes, slots)], axis=1)
        flat_mask = tf.reshape(mask, [-1])
        with tf.control_dependencies([check]):
            flat = tf.reshape(crops, [-1, size, size, 3])
        # Only the real fragments go through the CNN.
        features = tf.cast(self.image_cnn(tf.boolean_mask(flat, flat_mask), training=False), tf.float32)
        features = tf.scatter_nd(tf.cast(tf.where(flat_mask), tf.int32), features,
                                 tf.stack([tf.size(flat_mask), self.image_dim]))
        features = tf.reshape(features, tf.stack([batch, 1 + slots, self.image_dim]))
        features.set_shape([None, None, self.image_dim])
        mask.set_shape([None, None])
        return features, mask

    def _pair(self, image_fragments, image_mask, relation, word1, word2, sentence_mask):
        """Validated, padding-neutral embeddings and masks of a score / alignment request."""
        v, image_mask = self._image_side(image_fragments, image_mask)
        ids, sentence_mask = self._validate_ids(relation, word1, word2, sentence_mask)
        return v, image_mask, self._sentence(*ids), sentence_mask

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
        requests = [("embed_image_fragments", {"image_fragments": images}), ("embed_sentence_fragments", ids),
                    ("embed_sentence_fragment_strings", strings), ("score", pair), ("alignment", pair),
                    ("serving_default", pair)]
        # The parse-triplet inputs need a known fragment in every sentence.
        if word:
            requests.append(("embed_sentences", strings))
        image_input = {"image_fragments": images, "image_mask": image_mask}
        if self.image_cnn is not None:
            size = self.image_size
            # An S×S image and one of another shape (the resize), one box and none.
            image_input = {"image_jpeg": [warmup_jpeg(size, size), warmup_jpeg(size // 2 + 3, size + 5)],
                           "boxes": np.array([[[0, 0, 3, 3]], [[0, 0, 0, 0]]], np.float32),
                           "num_boxes": np.array([1, 0], np.int32)}
            requests.append(("embed_images", image_input))
            if word:
                requests.append(("score_jpeg", {**image_input, **strings}))
        if self.has_gallery:
            requests.append(("retrieve_captions", {**image_input, "k": np.int32(1)}))
            if word:
                requests.append(("retrieve_images", {**strings, "k": np.int32(1)}))
        return requests


def fragment_gallery(model: FragmentEmbeddingModel, split, image_ids: Sequence[str],
                     caption_ids: Sequence[str]) -> RetrievalGallery:
    """The retrieval gallery of a test split, embedded as ``model.evaluate`` embeds it.

    `split`: the fragment model's `EvaluationSplit` (or its dict):
    ``image`` = {"fragments": (N, M, D), "mask": (N, M)}, ``text`` =
    {"relation", "word1", "word2", "row_splits"}
    (`tf_twobranch.systems.fragments.pipeline.evaluation_split`). The
    gallery holds ``model.embed_split``'s image-fragment embeddings with
    their mask and each caption's sentence-fragment embeddings, padded to
    the longest caption, with theirs (a caption without fragments scores 0
    with every image, as in the evaluation).
    """
    if model.config.representation != "fragments":
        raise ConfigError(f"only the fragment representation is exported, got {model.config.representation!r}")
    split = as_evaluation_split(split)
    v, image_mask, s, row_splits = model.embed_split(split.image["fragments"], split.image["mask"], split.text)
    sentences, sentence_mask = padded_rows(np.asarray(s, np.float32), row_splits)
    return RetrievalGallery([str(i) for i in image_ids], np.asarray(v, np.float32), [str(c) for c in caption_ids],
                            sentences, image_mask=np.asarray(image_mask, bool), caption_mask=sentence_mask)


def triplet_request(sentences: Sequence[Sequence]) -> dict[str, list[list[str]]]:
    """The ``relation``, ``word1``, ``word2`` inputs of ``embed_sentences`` / ``score_jpeg`` /
    ``retrieve_images`` for a batch of parsed sentences: each a sequence of
    `tf_twobranch.systems.fragments.sentence_fragments.Triplet` (or (relation, governor,
    dependent) tuples), padded with empty strings to the longest sentence."""
    rows = [[(t.relation, t.word1, t.word2) if hasattr(t, "relation") else tuple(t) for t in sentence]
            for sentence in sentences]
    if not rows:
        raise ConfigError("triplet_request needs at least one sentence")
    width = max(1, max(len(r) for r in rows))
    padded = [r + [("", "", "")] * (width - len(r)) for r in rows]
    return {name: [[fragment[i] for fragment in row] for row in padded] for i, name in enumerate(ID_INPUTS)}


def export_fragment_model(model: FragmentEmbeddingModel, export_dir, *, relations: Sequence[str],
                          words: Sequence[str], image_cnn: keras.Model | None = None,
                          gallery: RetrievalGallery | None = None, gallery_block: int | None = None,
                          run_config: dict | None = None, overwrite: bool = True,
                          model_name: str = "fragments") -> pathlib.Path:
    """Writes the serving SavedModel of `model` to `export_dir` (atomically; see the module docstring).

    Args:
      model: a built (trained) `FragmentEmbeddingModel`.
      export_dir: output directory (replaced when `overwrite`).
      relations: the relation names in id order (``num_relations`` of them).
      words: the vocabulary in the row order of the frozen word vectors W_e
        (``vocabulary_size`` of them).
      image_cnn: the CNN of the run's image inputs (a crop S×S RGB 0..255 ->
        ``image_dim`` features; `tf_twobranch.systems.fragments.features.fragment_cnn`):
        adds ``embed_images`` and ``score_jpeg`` (JPEG bytes and boxes in).
      gallery: `fragment_gallery` of a split: adds ``retrieve_captions`` /
        ``retrieve_images`` (S_kl as ``evaluate`` ranks).
      gallery_block: gallery items scored per step of a retrieval request
        (default: as many as keep a query's fragment-pair scores near 4M floats).
      run_config: written to ``assets.extra/run_config.json`` (default
        ``{"model": model.config}``), with the relations and the serving
        signatures added.
      model_name: ``model_spec.name`` in the warm-up requests.

    The warm-up requests are run through the signatures before saving (a
    failure raises), as for every family (`save_module_atomically`).

    Raises:
      ConfigError: `relations` or `words` do not fit the model (count,
        empty or repeated names), or `image_cnn` does not output ``image_dim`` features.
      FileExistsError: `export_dir` exists and not `overwrite`.
    """
    if pathlib.Path(export_dir).exists() and not overwrite:
        raise FileExistsError(f"{export_dir} exists")
    module = FragmentServingModule(model, relations, words, image_cnn=image_cnn, gallery=gallery,
                                   gallery_block=gallery_block)
    config = dict(run_config) if run_config else {"model": model.config.to_dict()}
    config["fragment_export"] = {"relations": list(module.relation_names),
                                 "words": list(module.word_names),
                                 "vocabulary_size": len(module.word_names),
                                 "signatures": sorted(module.signatures())}
    if image_cnn is not None:
        config["fragment_export"].update(
            image_size=module.image_size,
            image_fragments="fragment 0 the whole image, then boxes[b, :num_boxes[b]] (inclusive [x1, y1, x2, "
                            "y2] pixels), each cropped and resized to image_size x image_size by PIL's bilinear "
                            "rule, then the CNN")
    if gallery is not None:
        config["fragment_export"].update(gallery_images=len(gallery.image_ids),
                                         gallery_captions=len(gallery.caption_ids))
    return save_module_atomically(module, export_dir, config, overwrite=overwrite, model_name=model_name)


# ---------------------------------------------------------------------------- a finished run

def run_export(run) -> RunExport:
    """A deep-fragment-embedding run: JPEG bytes + boxes through its kept CNN, parse triplets."""
    from tf_twobranch.data.formats.conllu import read_conllu
    from tf_twobranch.systems.fragments.sentence_fragments import tree_triplets
    from tf_twobranch.systems.fragments import pipeline

    recipe = pipeline.FragmentRecipe.from_record(run.config, str(run.run_dir / "run_config.json"))
    if run.model.config.representation != "fragments":
        raise UserInputError(f"{run.run_dir}: a {run.model.config.representation} row embeds whole images and "
                             "sentences; only the fragment representation is exported")
    data = pipeline.load_data(recipe)
    cnn, note = pipeline.serving_image_cnn(recipe, data, run.model.config)
    if note:
        logging.info("export: %s", note)
    relations, words = data.text.relations, data.text.word_vectors.words

    def split_gallery():
        corpus = data.splits[recipe.eval_split]
        split = pipeline.evaluation_split(recipe, data, run.model.config)
        return fragment_gallery(run.model, split, list(corpus.image_ids), caption_keys(corpus))

    def image_inputs(jpegs):
        # A folder's JPEGs come without proposals: fragment 0, the whole image, alone.
        return (jpegs, np.zeros((len(jpegs), 1, 4), np.float32), np.zeros(len(jpegs), np.int32))

    def text_inputs(path):
        if path.suffix.lower() != ".conllu":
            raise UserInputError(f"{path}: a fragment row's gallery captions are dependency parses (a parser "
                                 "cannot live in the SavedModel): give a CoNLL-U file (*.conllu, e.g. written by "
                                 "tf_twobranch.data.spacy_parses.write_caption_parses), one '# sent_id' per caption")
        trees = read_conllu(path)
        if not trees:
            raise UserInputError(f"{path}: the CoNLL-U file holds no parsed caption")
        ids = list(trees)
        triplets = [tree_triplets(trees[i], recipe.fragments, collapse_prepositions=recipe.collapse_prepositions)
                    for i in ids]

        def request(rows):
            out = triplet_request(rows)
            return tuple(out[name] for name in ("relation", "word1", "word2"))

        return ids, batched(triplets, request)

    def write(export_dir, gallery, block):
        return export_fragment_model(run.model, export_dir, relations=relations, words=words, image_cnn=cnn,
                                     gallery=gallery, gallery_block=block,
                                     run_config={"model": run.model.config.to_dict(),
                                                 **{k: run.config[k] for k in ("typed_flags", "recipe") if k in run.config},
                                                 "export_notes": [note] if note else []})

    return RunExport("fragments", recipe.eval_split, split_gallery,
                        lambda: FragmentServingModule(run.model, relations, words, image_cnn=cnn), write,
                        image_inputs=image_inputs, text_inputs=text_inputs,
                        no_image_gallery=note and note.replace(": the export takes image_fragments",
                                                               ": the export takes image_fragments, not JPEGs"))
