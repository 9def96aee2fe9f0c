"""The serving export of a finished run folder, with a retrieval gallery (issue 25 items 1–2).

`export_run(run_dir, export_dir, ...)` loads any run with `tf_twobranch.runs.load_run`,
rebuilds what its family's raw-input export needs and writes the export. `RUN_EXPORTERS` maps the
run's task (`run_folders.read_run_task`, the keys of `runs.RUN_LOADERS`) to the function that
gives its `FamilyExport`:

* image–sentence two-branch rows: the pipeline's `serving_inputs` (the backbone that computed the
  cached image features with the row's views, the fitted sentence encoder); a side whose features
  came from the user's files (or the precomp layout, or a random-init backbone) keeps feature
  inputs;
* phrase-localization two-branch rows: the region–phrase export (no retrieval gallery: these
  rows rank boxes for a phrase);
* the dual path and N-pair localization: their exports take JPEG bytes and captions already;
* deep fragment embeddings: JPEG bytes + boxes through the run's kept CNN
  (`pipelines.fragment_embeddings.serving_image_cnn`), parse triplets for sentences.

The gallery is the run's evaluated split (`gallery_from_model(run.model, split, ids)`: image ids
and ``<image>#<k>`` caption ids, embedded as ``evaluate`` embeds them), and/or a folder of JPEGs
and a caption file, embedded with the functions the export's ``retrieve_*`` signatures embed a
query with (`FamilyExport.module().query_image` / ``query_text``), so that a gallery item sent
as a query is embedded as the gallery holds it.
"""
from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tf_twobranch.data.formats._common import read_text
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.systems.fragments.sentence_fragments import caption_keys
from tf_twobranch.errors import UserInputError
from tf_twobranch.export import serving
from tf_twobranch.export.retrieval import gallery_from_model
from tf_twobranch.export.retrieval_signatures import RetrievalGallery
from tf_twobranch.run_folders import read_run_task
from tf_twobranch.runs import Run, load_run

__all__ = ["FamilyExport", "RUN_EXPORTERS", "export_run", "gallery_caption_ids", "read_gallery_captions",
           "list_gallery_images", "JPEG_SUFFIXES"]

JPEG_SUFFIXES = (".jpg", ".jpeg")
# Gallery items per embedding call: bounds the memory of a folder's pass through the CNN.
EMBED_BATCH = 16
_TOKEN_LINE = re.compile(r"^[^\t]+#\d+\t")

# The exporter of each task's runs (run_folders.TASKS), as "module:function" taking the loaded
# `Run` and returning its `FamilyExport`.
RUN_EXPORTERS = {
    "image_sentence_retrieval": "tf_twobranch.export.run_export:two_branch_export",
    "phrase_localization": "tf_twobranch.export.run_export:phrase_localization_export",
    "dual_path": "tf_twobranch.export.run_export:dual_path_export",
    "fragment_embeddings": "tf_twobranch.export.run_export:fragment_export",
    "npair_localization": "tf_twobranch.export.run_export:npair_export",
}


@dataclasses.dataclass
class FamilyExport:
    """What `export_run` needs of a family: its evaluated split as a gallery, a serving module
    to embed user galleries with, the request inputs of image files and captions, and the writer."""
    family: str
    split_name: str | None                          # the split the run was evaluated on (None: no gallery)
    split_gallery: Callable[[], RetrievalGallery] | None
    module: Callable[[], tf.Module] | None          # the serving module without gallery
    write: Callable[[pathlib.Path, RetrievalGallery | None, int | None], pathlib.Path]
    image_inputs: Callable[[list[bytes]], tuple] = lambda jpegs: (jpegs,)
    text_inputs: Callable[[pathlib.Path], tuple[list[str], tuple]] | None = None
    no_image_gallery: str | None = None             # why a folder of JPEGs cannot be embedded
    no_caption_gallery: str | None = None           # why a caption file cannot be embedded
    no_gallery: str | None = None                   # why the family has no retrieval gallery at all


# ---------------------------------------------------------------------------- gallery inputs

def gallery_caption_ids(image_ids: Sequence[str], caption_image) -> list[str]:
    """``<image id>#<k>`` of every caption, k its position among its image's captions (as
    `sentence_fragments.caption_keys` numbers a corpus)."""
    counts: dict[int, int] = {}
    out = []
    for image in np.asarray(caption_image).tolist():
        k = counts.get(image, 0)
        counts[image] = k + 1
        out.append(f"{image_ids[image]}#{k}")
    return out


def list_gallery_images(folder) -> list[pathlib.Path]:
    """The JPEG files of a gallery folder, sorted by name (their stems are the gallery ids)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise UserInputError(f"{folder}: the gallery image folder does not exist (expected a folder of JPEG "
                             "files, *.jpg or *.jpeg)")
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in JPEG_SUFFIXES)
    if not paths:
        raise UserInputError(f"{folder}: no JPEG files (*.jpg, *.jpeg) in the gallery image folder")
    stems = [p.stem for p in paths]
    repeated = sorted({s for s in stems if stems.count(s) > 1})
    if repeated:
        raise UserInputError(f"{folder}: gallery ids are the file names without extension; {repeated[:3]} "
                             "occur twice (e.g. a.jpg and a.jpeg)")
    return paths


def read_gallery_captions(path) -> tuple[list[str], list[str]]:
    """(ids, captions) of a gallery caption file: the dataset's token format
    (``<image>.jpg#<k>\\t<caption>``, read by `read_token_file`; ids ``<image>#<k>``) or one
    caption per line (blank lines skipped; ids the 1-based line numbers)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise UserInputError(f"{path}: the gallery caption file does not exist (expected one caption per line, "
                             "or '<image>.jpg#<k><TAB><caption>' lines)")
    lines = read_text(path).splitlines()
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise UserInputError(f"{path}: the gallery caption file has no caption (expected one caption per "
                             "line, or '<image>.jpg#<k><TAB><caption>' lines)")
    if _TOKEN_LINE.match(first):
        corpus = read_token_file(path)
        return caption_keys(corpus), list(corpus.captions)
    numbered = [(str(n), line.strip()) for n, line in enumerate(lines, start=1) if line.strip()]
    return [n for n, _ in numbered], [c for _, c in numbered]


def _embed(fn, batches: Sequence[tuple], what: str, source) -> tuple[np.ndarray, np.ndarray | None]:
    """`fn`'s outputs over `batches`, concatenated: embeddings (rows, ..., d) and, where `fn`
    returns ``(embeddings, mask)``, the mask (rows, slots), padded to the widest batch."""
    outputs, masks = [], []
    start = 0
    for inputs in batches:
        try:
            out = fn(*inputs)
        except tf.errors.InvalidArgumentError as err:
            message = err.message.strip().splitlines()[0]
            raise UserInputError(f"{source}: the export refuses a gallery {what} among items {start}.."
                                 f"{start + len(inputs[0]) - 1} (indices below are within that batch): "
                                 f"{message}") from None
        if isinstance(out, (tuple, list)):
            out, mask = out
            masks.append(np.asarray(mask, bool))
        outputs.append(np.asarray(out, np.float32))
        start += len(inputs[0])
    if not masks:
        return np.concatenate(outputs), None
    width = max(m.shape[1] for m in masks)
    padded = [np.pad(o, [(0, 0), (0, width - o.shape[1])] + [(0, 0)] * (o.ndim - 2)) for o in outputs]
    return np.concatenate(padded), np.concatenate([np.pad(m, [(0, 0), (0, width - m.shape[1])]) for m in masks])


def _batched(items: list, request: Callable[[list], tuple]) -> list[tuple]:
    return [request(items[i:i + EMBED_BATCH]) for i in range(0, len(items), EMBED_BATCH)]


def _user_side(fe: FamilyExport, module, images_dir=None, captions_file=None):
    """(ids, embeddings, mask) of a gallery folder of JPEGs or a caption file, embedded by the
    export's query functions (a tf.function of the signatures' input specs, as they run)."""
    image_specs, text_specs = module.query_specs
    if images_dir is not None:
        paths = list_gallery_images(images_dir)
        fn = serving.signature_function(*image_specs)(module.query_image)
        jpegs = [p.read_bytes() for p in paths]
        embeddings, mask = _embed(fn, _batched(jpegs, fe.image_inputs), "image", images_dir)
        return [p.stem for p in paths], embeddings, mask
    ids, batches = fe.text_inputs(pathlib.Path(captions_file))
    fn = serving.signature_function(*text_specs)(module.query_text)
    embeddings, mask = _embed(fn, batches, "caption", captions_file)
    return ids, embeddings, mask


def build_gallery(fe: FamilyExport, gallery: str | None, images_dir=None, captions_file=None
                  ) -> RetrievalGallery | None:
    """The export's gallery: the run's evaluated split (`gallery` "test"/"val"; None: the
    evaluated split when no file replaces both sides) with a side replaced by the folder of
    JPEGs or the caption file; None for ``gallery="none"`` without files."""
    user = images_dir is not None or captions_file is not None
    if fe.no_gallery is not None:
        if user or gallery not in (None, "none"):
            raise UserInputError(f"{fe.no_gallery}: pass --gallery=none and no --gallery_images / "
                                 "--gallery_captions")
        return None
    if images_dir is not None and fe.no_image_gallery:
        raise UserInputError(f"--gallery_images={images_dir}: {fe.no_image_gallery}; a folder of JPEGs cannot be "
                             "embedded (give --gallery_images only for rows whose export takes image_jpeg)")
    if captions_file is not None and fe.no_caption_gallery:
        raise UserInputError(f"--gallery_captions={captions_file}: {fe.no_caption_gallery}")
    if gallery is None:
        gallery = "none" if images_dir is not None and captions_file is not None else fe.split_name
    if gallery == "none" and not user:
        return None
    base = None
    if gallery != "none":
        if gallery != fe.split_name:
            raise UserInputError(f"--gallery={gallery}: the run was evaluated on its {fe.split_name} split, the "
                                 f"only split whose inputs it keeps; use --gallery={fe.split_name}, or give that "
                                 "split's images and captions with --gallery_images / --gallery_captions")
        if not (images_dir is not None and captions_file is not None):
            base = fe.split_gallery()
    elif images_dir is None or captions_file is None:
        missing = "--gallery_captions" if captions_file is None else "--gallery_images"
        raise UserInputError(f"--gallery=none with only one gallery file: retrieval ranks both ways, so it "
                             f"needs {missing} too (or --gallery={fe.split_name} for the run's split)")
    module = fe.module() if user else None
    image_side = (_user_side(fe, module, images_dir=images_dir) if images_dir is not None
                  else (base.image_ids, base.image_embeddings, base.image_mask))
    caption_side = (_user_side(fe, module, captions_file=captions_file) if captions_file is not None
                    else (base.caption_ids, base.caption_embeddings, base.caption_mask))
    return RetrievalGallery(list(image_side[0]), image_side[1], list(caption_side[0]), caption_side[1],
                            image_mask=image_side[2], caption_mask=caption_side[2])


def export_run(run_dir, export_dir, *, gallery: str | None = None, gallery_images=None, gallery_captions=None,
               gallery_block: int | None = None, checkpoint: str = "latest") -> pathlib.Path:
    """Writes the serving export of the run in `run_dir` to `export_dir` (see the module docstring).

    `gallery`: "test" / "val" (must be the split the run was evaluated on), "none", or None
    (the evaluated split, unless both a folder and a caption file are given). `gallery_images`:
    a folder of JPEGs (ids: file names without extension); `gallery_captions`: a caption file
    (`read_gallery_captions`; for fragment rows CoNLL-U parses). `gallery_block`: gallery items
    scored per step of a retrieval request (fragment / N-pair exports; None: their default).

    Raises:
      UserInputError: a missing run folder, a gallery folder without JPEGs, an empty caption file,
        a gallery the family's export cannot embed (feature inputs, no gallery), ...
    """
    run_dir = pathlib.Path(run_dir)
    if gallery not in (None, "test", "val", "none"):
        raise UserInputError(f"--gallery must be test, val or none, got {gallery!r}")
    if gallery_block is not None and gallery_block < 1:
        raise UserInputError(f"--gallery_block must be positive, got {gallery_block}")
    if not run_dir.is_dir():
        raise UserInputError(f"{run_dir}: run folder does not exist")
    if gallery_images is not None:
        list_gallery_images(gallery_images)         # checked before the (slow) model load
    if gallery_captions is not None and not pathlib.Path(gallery_captions).is_file():
        raise UserInputError(f"{gallery_captions}: the gallery caption file does not exist")
    found = read_run_task(run_dir)
    run = load_run(run_dir, checkpoint)
    module, function = RUN_EXPORTERS[found[0].name].split(":")
    fe = getattr(importlib.import_module(module), function)(run)
    chosen = build_gallery(fe, gallery, gallery_images, gallery_captions)
    if chosen is not None:
        logging.info("gallery: %d images, %d captions", len(chosen.image_ids), len(chosen.caption_ids))
    return fe.write(pathlib.Path(export_dir), chosen, gallery_block)


# ---------------------------------------------------------------------------- families

def _plain_captions(path: pathlib.Path) -> tuple[list[str], list[tuple]]:
    ids, captions = read_gallery_captions(path)
    return ids, _batched(captions, lambda items: (items,))


def two_branch_export(run: Run) -> FamilyExport:
    """An image–sentence row: raw inputs where the pipeline knows the row's feature pieces."""
    from tf_twobranch.data.retrieval_data import load_caption_splits
    from tf_twobranch.systems.two_branch.export import TwoBranchServingModule, export_saved_model
    from tf_twobranch.systems.two_branch import pipeline

    recipe = pipeline.RetrievalRecipe.from_record(run.results or run.config, str(run.run_dir / "results.json"))
    layout = pipeline.dataset_layout(recipe)
    corpora = load_caption_splits(layout)
    splits = {s: corpora[s] for s in ("train", "test")}
    raw_inputs, notes = pipeline.serving_inputs(recipe, layout, splits)
    for note in notes:
        logging.info("export: %s", note)
    views = {k: raw_inputs[k] for k in ("ten_crop", "crop_size", "resize_to") if k in raw_inputs}
    text_encoder = raw_inputs.get("text_encoder")

    def module():
        from tf_twobranch.features.tf_text_features import text_feature_layer_from_encoder
        layer = None if text_encoder is None else text_feature_layer_from_encoder(text_encoder)
        return TwoBranchServingModule(run.model, text_layer=layer, image_backbone=raw_inputs.get("image_backbone"),
                                      image_views=views)

    def split_gallery():
        test = splits["test"]
        return gallery_from_model(run.model, run.evaluation_split(), list(test.image_ids), caption_keys(test))

    def write(export_dir, gallery, _block):
        return export_saved_model(run.model, export_dir, **raw_inputs, gallery=gallery,
                                  run_config={**run.config, "serving": {"notes": notes}})

    feature_side = {n.split(":")[0]: n for n in notes}
    return FamilyExport(
        "two_branch", "test", split_gallery, module, write, text_inputs=_plain_captions,
        no_image_gallery=("the export takes image_features (" + feature_side["image side"] + ")"
                          if "image_backbone" not in raw_inputs else None),
        no_caption_gallery=("the export takes text_features (" + feature_side["text side"] + ")"
                            if "text side" in feature_side else None))


def phrase_localization_export(run: Run) -> FamilyExport:
    """A phrase-localization row: the region–phrase export its experiment writes."""
    from tf_twobranch.systems.two_branch.region_phrase_export import export_phrase_localization_run

    inputs = (run.results or {}).get("inputs")
    if not isinstance(inputs, dict):
        raise UserInputError(f"{run.run_dir}: results.json records no 'inputs' (backbone, encoder) of the "
                             "phrase-localization run (the run did not finish)")

    def write(export_dir, _gallery, _block):
        return export_phrase_localization_run(run.model, inputs, export_dir, run_config=run.config)

    return FamilyExport("two_branch", None, None, None, write,
                        no_gallery=f"{run.run_dir}: a phrase-localization run ranks boxes for a phrase, not a "
                                   "retrieval gallery (its export is score_proposals)")


def dual_path_export(run: Run) -> FamilyExport:
    """A dual-path run: JPEG bytes and captions in; the gallery is its recorded test recipe."""
    from tf_twobranch.systems.dual_path.data import dual_path_data
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.systems.dual_path.export import DualPathServingModule, export_dual_path
    from tf_twobranch.runs import dual_path_test_split

    record = (run.results or {}).get("evaluation") or {}
    vocabulary = run.config.get("vocabulary")
    if record.get("kind") != "dual_path" or not vocabulary:
        raise UserInputError(f"{run.run_dir}: a dual-path run needs results.json 'evaluation' (its test recipe) "
                             "and run_config.json 'vocabulary' (written by the experiment when it finishes)")

    def split_gallery():
        pedes = record["dataset_kind"] == "pedes"
        layout = resolve_dataset(record["dataset_dir"], caption_format=record["caption_format"],
                                 images_dir=record["images_dir"],
                                 captions_path=record["caption_file"] if pedes else None)
        data = dual_path_data(layout, record["split"], dataset_kind=record["dataset_kind"], vocabulary=vocabulary,
                              max_len=record["max_len"], long_captions=record["long_captions"],
                              max_images=record["max_images"])
        return gallery_from_model(run.model, dual_path_test_split(record, data), list(data.image_ids),
                                  gallery_caption_ids(data.image_ids, data.caption_image))

    def write(export_dir, gallery, _block):
        return export_dual_path(run.model, vocabulary, export_dir, resize_to=record.get("resize_to"),
                                run_config={key: run.config[key] for key in ("model", "typed_flags", "flags", "recipe")
                                            if key in run.config}, gallery=gallery)

    return FamilyExport("dual_path", record["split"], split_gallery,
                        lambda: DualPathServingModule(run.model, vocabulary), write, text_inputs=_plain_captions)


def fragment_export(run: Run) -> FamilyExport:
    """A deep-fragment-embedding run: JPEG bytes + boxes through its kept CNN, parse triplets."""
    from tf_twobranch.data.formats.conllu import read_conllu
    from tf_twobranch.systems.fragments.sentence_fragments import tree_triplets
    from tf_twobranch.systems.fragments.export import (FragmentServingModule, export_fragment_model,
                                                        fragment_gallery, triplet_request)
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

        return ids, _batched(triplets, request)

    def write(export_dir, gallery, block):
        return export_fragment_model(run.model, export_dir, relations=relations, words=words, image_cnn=cnn,
                                     gallery=gallery, gallery_block=block,
                                     run_config={"model": run.model.config.to_dict(),
                                                 **{k: run.config[k] for k in ("typed_flags", "recipe") if k in run.config},
                                                 "export_notes": [note] if note else []})

    return FamilyExport("fragment_embedding", recipe.eval_split, split_gallery,
                        lambda: FragmentServingModule(run.model, relations, words, image_cnn=cnn), write,
                        image_inputs=image_inputs, text_inputs=text_inputs,
                        no_image_gallery=note and note.replace(": the export takes image_fragments",
                                                               ": the export takes image_fragments, not JPEGs"))


def npair_export(run: Run) -> FamilyExport:
    """An N-pair localization run: JPEG bytes and captions in (S_MaxImage or the row's aggregator)."""
    from tf_twobranch.systems.npair.export import NPairServingModule, export_npair_model

    vocabulary = run.config.get("vocabulary")
    recipe = (run.results or {}).get("recipe") or run.config.get("recipe") or {}

    def split_gallery():
        split = run.evaluation_split()
        return gallery_from_model(run.model, split, list(split.image_ids),
                                  gallery_caption_ids(split.image_ids, split.caption_image))

    def write(export_dir, gallery, block):
        # A run recorded before --point_rule existed was scored by LocNet's argmax rule.
        return export_npair_model(run.model, export_dir, vocabulary=vocabulary, gallery=gallery, gallery_block=block,
                                  run_config={"model": run.model.config.to_dict(), "recipe": recipe},
                                  point_rule=recipe.get("point_rule", "argmax"))

    return FamilyExport("npair_localization", recipe.get("eval_split", "test"), split_gallery,
                        lambda: NPairServingModule(run.model, vocabulary), write, text_inputs=_plain_captions)
