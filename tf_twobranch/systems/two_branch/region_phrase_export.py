"""End-to-end SavedModel for phrase localization: image bytes + boxes + phrases → scores.

`export_region_phrase_model` bundles, in one graph, everything between a
JPEG and the region–phrase scores of a trained two-branch model (TPAMI §4):

image bytes → decode → crop every proposal and warp it to the backbone input
→ CNN backbone → region (image) tower;  phrase strings → tokenize → in-graph
text encoder (`tf_twobranch.features.tf_text_features`) → phrase (text) tower;
then the score of every (phrase, proposal) pair.

Signatures:

* ``score_proposals`` (also ``serving_default``): ``image_jpeg`` string
  scalar (JPEG/PNG/BMP/GIF bytes), ``proposals`` float32 (N, 4)
  ``[x1, y1, x2, y2]`` in 0-based pixels, ``phrases`` string (P,) →
  ``scores`` float32 (P, N) (embedding network: cosine similarity of the
  L2-normalised tower embeddings; similarity network: the head's logit),
  ``best_box`` float32 (P, 4) (the best-scoring proposal, as given) and
  ``best_index`` int32 (P,).
* ``embed_regions``: ``image_jpeg``, ``proposals`` → ``region_embedding`` (N, d).
* ``embed_phrases``: ``phrases`` → ``phrase_embedding`` (P, d).

Box convention (``box_convention``, recorded in ``assets.extra/run_config.json``):
``"inclusive"`` (default; the package convention of `tf_twobranch.boxes`,
proposal files and Flickr30K Entities: x2, y2 are the last pixel inside the
box, so ``0 <= x1 <= x2 <= W-1``) or ``"half_open"`` (the convention of
`extract_region_features`: ``0 <= x1 < x2 <= W``). An inclusive box ``b`` is
cropped exactly as `extract_region_features` crops ``b + [0, 0, 1, 1]``;
fractional coordinates are expanded outward to whole pixels in both cases.

Pixel agreement with the Python path (`load_image` + `extract_region_features`):

* JPEGs are decoded with libjpeg's accurate integer DCT, the decoder PIL
  uses: decoded pixels are identical (TF's default fast DCT differs by up to
  ~20 grey levels).
* Each crop ``image[y1:y2, x1:x2]`` is resized with `tf.image.resize`
  (bilinear, antialiased), rounded to uint8 like PIL's resize: crops differ
  from PIL's by at most 1 grey level (PIL's fixed-point rounding), on about
  15% of the values. `tf.image.crop_and_resize` is *not* used: it samples
  the whole image, so border rows blend in pixels outside the box, and it
  has no antialiasing when shrinking; measured against PIL it differs by up
  to ~100 grey levels.

``assets.extra`` holds ``run_config.json`` and the TF Serving warm-up file
``tf_serving_warmup_requests`` (one small request per signature). See
docs/SERVING.md for requests and error messages.

The graph uses tensorflow-text's tokenizer ops: ``import tensorflow_text``
before ``tf.saved_model.load`` (TF Serving needs a build with those ops).

Requests are validated inside the graph; bad ones fail with
``InvalidArgumentError`` whose message says what is wrong: ``image_jpeg``
that is not one scalar string or not an image, proposals that are not
(N, 4) with N >= 1, non-finite, empty (zero area) or outside the image,
``phrases`` that is not a non-empty (P,) batch or holds an empty
(whitespace-only) phrase (`tf_twobranch.export.serving.validate_strings`).
A phrase whose words are all unknown to the text encoder is valid: it gets
the encoder's no-known-word features (see `tf_text_features`).
"""
from __future__ import annotations

import json
import pathlib

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.export.run_gallery import RunExport
from tf_twobranch.export import serving
from tf_twobranch.export.saved_model import save_module_atomically, warmup_jpeg
from tf_twobranch.features.backbones import backbone_input_size, build_backbone
from tf_twobranch.features.text_features import TextEncoder, load_text_encoder
from tf_twobranch.features.tf_text_features import text_feature_layer_from_encoder
from tf_twobranch.image_decoding import tf_decode_image
from tf_twobranch.systems.two_branch.model import TwoBranchModel

__all__ = ["BOX_CONVENTIONS", "decode_image_exact", "crop_regions", "RegionPhraseServingModule",
           "export_region_phrase_model", "export_phrase_localization_run", "region_phrase_run_export"]

BOX_CONVENTIONS = ("inclusive", "half_open")


def decode_image_exact(image_bytes):
    """uint8 (H, W, 3) from JPEG/PNG/BMP/GIF bytes, pixel-identical to PIL for JPEGs.

    `tf_twobranch.image_decoding.tf_decode_image` (decoded at the image's
    own size, no resize), with its errors naming the ``image_jpeg`` input:
    bytes that are not an image raise InvalidArgumentError naming the
    expected formats.
    """
    return tf_decode_image(image_bytes, name="image_jpeg")


def _check_proposals(proposals, height, width, box_convention: str):
    """Asserts (N, 4), N >= 1, finite, non-empty boxes inside the image; returns the checks."""
    # The shape as fed, not as declared (serving.fed_shape): a direct client may send any shape.
    shape = serving.fed_shape(proposals)
    rank_ok = tf.equal(tf.size(shape), 2)
    width_ok = rank_ok & tf.equal(serving.fed_dim(shape, -1), 4)
    checks = [
        tf.debugging.Assert(width_ok, ["proposals must have shape (N, 4) as [x1, y1, x2, y2]; got shape", shape]),
        tf.debugging.Assert(tf.logical_not(width_ok) | (serving.fed_dim(shape, 0) > 0),
                            ["proposals is empty; expected at least one box"]),
    ]
    # Another shape reads one box inside any image instead: only the checks above fail.
    proposals = serving.fed_or_stand_in(proposals, shape, width_ok & (serving.fed_dim(shape, 0) > 0), [None, 4],
                                        lambda: tf.zeros([1, 4]))
    with tf.control_dependencies(checks):
        checks.append(tf.debugging.assert_all_finite(proposals, "proposals contain NaN or inf coordinates"))
    x1, y1, x2, y2 = tf.unstack(proposals, axis=1)
    w, h = tf.cast(width, tf.float32), tf.cast(height, tf.float32)
    if box_convention == "inclusive":
        empty = tf.logical_or(x2 < x1, y2 < y1)
        outside = tf.reduce_any(tf.stack([x1 < 0, y1 < 0, x2 > w - 1, y2 > h - 1]), axis=0)
        rule = "0 <= x1 <= x2 <= width-1 and 0 <= y1 <= y2 <= height-1 (0-based, inclusive)"
    else:
        empty = tf.logical_or(x2 <= x1, y2 <= y1)
        outside = tf.reduce_any(tf.stack([x1 < 0, y1 < 0, x2 > w, y2 > h]), axis=0)
        rule = "0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height (0-based, half-open)"
    # The messages' index and box are computed on a padded copy: with no box at all they must not
    # fail before the "proposals is empty" check does (the graph may run them in either order).
    padded = tf.concat([proposals, tf.zeros([1, 4], proposals.dtype)], axis=0)

    def first(mask):
        return tf.argmax(tf.concat([tf.cast(mask, tf.int32), [0]], axis=0))

    checks.append(tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(empty)),
        [f"proposals: zero-area box (expected {rule}); first bad box index:",
         first(empty), "box:", tf.gather(padded, first(empty))],
        summarize=8))
    checks.append(tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(outside)),
        ["proposals: box outside the image (expected " + rule + "); image height, width:", height, width,
         "first bad box index:", first(outside), "box:", tf.gather(padded, first(outside))],
        summarize=8))
    return proposals, checks


def crop_regions(image, proposals, crop_size: int, *, box_convention: str = "inclusive"):
    """Crops every box of an (H, W, 3) uint8 image and warps it to crop_size² (float32 0..255).

    Same geometry and (up to one grey level) the same pixels as
    `extract_region_features`; see the module docstring. Boxes are not
    validated here (`RegionPhraseServingModule` does it).
    """
    if box_convention not in BOX_CONVENTIONS:
        raise ConfigError(f"box_convention must be one of {BOX_CONVENTIONS}, got {box_convention!r}")
    proposals = tf.convert_to_tensor(proposals, tf.float32)
    if box_convention == "inclusive":
        proposals = proposals + tf.constant([0.0, 0.0, 1.0, 1.0])
    pixels = tf.cast(tf.concat([tf.floor(proposals[:, :2]), tf.math.ceil(proposals[:, 2:])], axis=1), tf.int32)
    image = tf.convert_to_tensor(image)

    def crop(box):
        region = image[box[1]:box[3], box[0]:box[2], :]
        resized = tf.image.resize(tf.cast(region, tf.float32), [crop_size, crop_size], method="bilinear",
                                  antialias=True)
        # PIL resizes uint8 images to uint8: round like it does.
        return tf.clip_by_value(tf.round(resized), 0.0, 255.0)

    return tf.map_fn(crop, pixels, fn_output_signature=tf.TensorSpec([crop_size, crop_size, 3], tf.float32))


class RegionPhraseServingModule(tf.Module):
    """Serving signatures of a region–phrase model (see the module docstring)."""

    def __init__(self, model: TwoBranchModel, image_backbone: keras.Model, text_layer: keras.layers.Layer, *,
                 crop_size: int, box_convention: str = "inclusive", region_batch_size: int = 64):
        super().__init__(name="region_phrase_serving")
        if box_convention not in BOX_CONVENTIONS:
            raise ConfigError(f"box_convention must be one of {BOX_CONVENTIONS}, got {box_convention!r}")
        if region_batch_size < 1:
            raise ConfigError(f"region_batch_size must be positive, got {region_batch_size}")
        self.model_config_json = tf.Variable(json.dumps(model.config.to_dict()), trainable=False,
                                             name="model_config")
        self.backbone = image_backbone
        self.text_encoder = text_layer
        self.image_tower = model.image_tower
        self.text_tower = model.text_tower
        self.similarity_head = model.similarity_head
        self.crop_size = int(crop_size)
        self.box_convention = box_convention
        self.region_batch_size = int(region_batch_size)
        serving.track_keras_variables(self, image_backbone, text_layer, self.image_tower, self.text_tower,
                                      self.similarity_head)

        # The fixed sizes are declared (one image, (N, 4) boxes, a batch of phrases) so TF
        # Serving's metadata tells a client what to send; the package's callers refuse another
        # rank by name before the graph runs, and the graph checks the rest (tf_twobranch.export.serving).
        image_spec = tf.TensorSpec([], tf.string, name="image_jpeg")
        proposals_spec = tf.TensorSpec([None, 4], tf.float32, name="proposals")
        phrases_spec = serving.string_batch_spec("phrases", static_shape=True)

        @serving.signature_function(image_spec, proposals_spec, phrases_spec)
        def score_proposals(image_jpeg, proposals, phrases):
            boxes, regions = self._regions(image_jpeg, proposals)
            phrase_embeddings = self._phrases(phrases)
            scores = self._scores(regions, phrase_embeddings)
            best = tf.argmax(scores, axis=1, output_type=tf.int32)
            return {"scores": scores, "best_box": tf.gather(boxes, best), "best_index": best}

        @serving.signature_function(image_spec, proposals_spec)
        def embed_regions(image_jpeg, proposals):
            return {"region_embedding": self._regions(image_jpeg, proposals)[1]}

        @serving.signature_function(phrases_spec)
        def embed_phrases(phrases):
            return {"phrase_embedding": self._phrases(phrases)}

        self.score_proposals = score_proposals
        self.embed_regions = embed_regions
        self.embed_phrases = embed_phrases

    def _backbone_features(self, crops):
        # Fixed-size chunks bound the backbone's peak memory for many proposals.
        n = tf.shape(crops)[0]
        b = self.region_batch_size
        chunks = (n + b - 1) // b
        padded = tf.pad(crops, [[0, chunks * b - n], [0, 0], [0, 0], [0, 0]])
        padded = tf.reshape(padded, [chunks, b, self.crop_size, self.crop_size, 3])
        dim = int(self.backbone.output_shape[-1])
        features = tf.map_fn(lambda x: self.backbone(x, training=False), padded,
                             fn_output_signature=tf.TensorSpec([b, dim], tf.float32))
        return tf.reshape(features, [-1, dim])[:n]

    def _regions(self, image_jpeg, proposals):
        shape = serving.fed_shape(image_jpeg)
        scalar_check = tf.debugging.Assert(
            tf.equal(tf.size(shape), 0),
            ["image_jpeg must be one encoded image (a scalar string, shape ()); got a tensor of shape", shape])
        # Several images: the first stands in (one whose boxes fit), so only the check above fails.
        image_jpeg = serving.fed_or_stand_in(image_jpeg, shape, tf.equal(tf.size(shape), 0), [],
                                             lambda: tf.concat([tf.reshape(image_jpeg, [-1]), [""]], axis=0)[0])
        image = decode_image_exact(image_jpeg)
        boxes, checks = _check_proposals(proposals, tf.shape(image)[0], tf.shape(image)[1], self.box_convention)
        with tf.control_dependencies(checks):
            boxes = tf.identity(boxes)
        crops = crop_regions(image, boxes, self.crop_size, box_convention=self.box_convention)
        features = self._backbone_features(crops)
        embeddings = self.image_tower(features, training=False)
        return boxes, tf.nn.l2_normalize(embeddings, axis=-1, epsilon=1e-24)

    def _phrases(self, phrases):
        features = self.text_encoder(serving.validate_strings(phrases, "phrases"))
        embeddings = self.text_tower(features, training=False)
        return tf.nn.l2_normalize(embeddings, axis=-1, epsilon=1e-24)

    def _scores(self, regions, phrases):
        if self.similarity_head is None:
            return tf.matmul(phrases, regions, transpose_b=True)
        joint = tf.reshape(phrases[:, None, :] * regions[None, :, :], [-1, tf.shape(regions)[-1]])
        logits = self.similarity_head(joint, training=False)
        return tf.reshape(logits, [tf.shape(phrases)[0], tf.shape(regions)[0]])

    def signatures(self) -> dict:
        return {"serving_default": self.score_proposals, "score_proposals": self.score_proposals,
                "embed_regions": self.embed_regions, "embed_phrases": self.embed_phrases}

    def warmup_requests(self) -> list[tuple[str, dict]]:
        """One small valid request per signature: a grey 48x64 JPEG, two boxes, two phrases."""
        height, width = 48, 64
        jpeg = warmup_jpeg(height, width)
        if self.box_convention == "inclusive":
            boxes = np.array([[0, 0, width - 1, height - 1], [8, 4, 40, 30]], np.float32)
        else:
            boxes = np.array([[0, 0, width, height], [8, 4, 41, 31]], np.float32)
        phrases = ["a dog", "the red car"]
        image = np.array(jpeg, dtype=object)  # scalar string tensor
        both = {"image_jpeg": image, "proposals": boxes, "phrases": phrases}
        return [("embed_regions", {"image_jpeg": image, "proposals": boxes}),
                ("embed_phrases", {"phrases": phrases}),
                ("score_proposals", both), ("serving_default", both)]


def _check_compatible(model: TwoBranchModel, image_backbone: keras.Model, text_layer, crop_size: int) -> None:
    cfg = model.config
    if cfg.text_encoder != "features":
        raise ConfigError("export_region_phrase_model needs a model on text features (text_encoder='features'), "
                          f"got text_encoder={cfg.text_encoder!r}")
    input_size = backbone_input_size(image_backbone)
    if int(crop_size) != input_size:
        raise ConfigError(f"crop_size {crop_size} differs from the backbone input size {input_size}")
    backbone_dim = int(image_backbone.output_shape[-1])
    if backbone_dim != cfg.image_dim:
        raise ConfigError(f"the backbone outputs {backbone_dim}-d features but the model's image_dim is {cfg.image_dim}")
    if text_layer.output_dim != cfg.text_dim:
        raise ConfigError(f"the text encoder outputs {text_layer.output_dim}-d features but the model's "
                          f"text_dim is {cfg.text_dim}")


def export_region_phrase_model(model: TwoBranchModel, image_backbone: keras.Model,
                               text_encoder: TextEncoder | keras.layers.Layer, export_dir, *, crop_size: int,
                               run_config: dict | None = None, box_convention: str = "inclusive",
                               region_batch_size: int = 64, model_name: str = "region_phrase",
                               overwrite: bool = True) -> pathlib.Path:
    """Writes the end-to-end region–phrase SavedModel to `export_dir`.

    Args:
      model: a trained `TwoBranchModel` on text features (embedding or
        similarity network) whose image tower takes backbone features.
      image_backbone: the CNN that produced the region features (float RGB
        0..255 in, (batch, image_dim) out), e.g. from `build_backbone`.
      text_encoder: the fitted numpy encoder that produced the phrase
        features (converted with `text_feature_layer_from_encoder`), or an
        already built in-graph layer from `tf_text_features`.
      export_dir: output directory (replaced when `overwrite`).
      crop_size: side proposals are warped to; must equal the backbone input.
      run_config: written to ``assets.extra/run_config.json`` with an added
        ``"region_phrase_export"`` entry (crop size, box convention, text
        encoder); default ``{"model": model.config}``.
      box_convention: "inclusive" or "half_open" (see the module docstring).
      region_batch_size: proposals per backbone call inside the graph.
      model_name: ``model_spec.name`` of the warm-up requests written to
        ``assets.extra/tf_serving_warmup_requests`` (one per signature, run
        once before saving).

    Returns:
      The export directory.

    Raises:
      ConfigError: the parts do not fit together (dimensions, crop size,
        LSTM text tower, unknown encoder or box convention).
    """
    export_dir = pathlib.Path(export_dir)
    text_layer = (text_feature_layer_from_encoder(text_encoder) if isinstance(text_encoder, TextEncoder)
                  else text_encoder)
    if not hasattr(text_layer, "output_dim"):
        raise ConfigError(f"text_encoder must be a fitted text encoder or a tf_text_features layer, "
                          f"got {type(text_encoder).__name__}")
    _check_compatible(model, image_backbone, text_layer, crop_size)
    if export_dir.exists() and not overwrite:
        raise FileExistsError(f"{export_dir} exists")
    module = RegionPhraseServingModule(model, image_backbone, text_layer, crop_size=crop_size,
                                       box_convention=box_convention, region_batch_size=region_batch_size)
    config = dict(run_config) if run_config else {"model": model.config.to_dict()}
    config["region_phrase_export"] = {
        "crop_size": int(crop_size), "box_convention": box_convention, "backbone": image_backbone.name,
        "text_encoder": text_encoder.get_config() if isinstance(text_encoder, TextEncoder)
        else {"layer": type(text_layer).__name__, "dim": int(text_layer.output_dim)},
        "signatures": sorted(module.signatures()),
    }
    return save_module_atomically(module, export_dir, config, overwrite=overwrite, model_name=model_name)


def export_phrase_localization_run(model: TwoBranchModel, inputs: dict, export_dir, *,
                                   run_config: dict | None = None) -> pathlib.Path:
    """The export of a phrase-localization run (what `experiments.two_branch_draw
    --saved_model` and TF Serving take): the trained model between the region
    backbone and the fitted phrase encoder the run recorded (results.json
    ``inputs``: ``backbone``, ``backbone_weights``, ``text_encoder``).
    Proposals are warped to the backbone's input size, as the region features
    were."""
    backbone = build_backbone(inputs["backbone"], weights_path=inputs["backbone_weights"])
    encoder = load_text_encoder(inputs["text_encoder"])
    return export_region_phrase_model(model, backbone, encoder, export_dir,
                                      crop_size=backbone_input_size(backbone), run_config=run_config)


# ---------------------------------------------------------------------------- a finished run

def region_phrase_run_export(run) -> RunExport:
    """A phrase-localization row: the region–phrase export its experiment writes."""
    inputs = (run.results or {}).get("inputs")
    if not isinstance(inputs, dict):
        raise UserInputError(f"{run.run_dir}: results.json records no 'inputs' (backbone, encoder) of the "
                             "phrase-localization run (the run did not finish)")

    def write(export_dir, _gallery, _block):
        return export_phrase_localization_run(run.model, inputs, export_dir, run_config=run.config)

    return RunExport("two_branch", None, None, None, write,
                        no_gallery=f"{run.run_dir}: a phrase-localization run ranks boxes for a phrase, not a "
                                   "retrieval gallery (its export is score_proposals)")
