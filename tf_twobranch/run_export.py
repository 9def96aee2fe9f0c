"""The serving export of a finished run folder, with a retrieval gallery (issue 25 items 1–2), and
the gallery a model of any system embeds. A run-level app: it reaches a system only through the
`tf_twobranch.systems` registry, like `tf_twobranch.runs.load_run`.

`export_run(run_dir, export_dir, ...)` loads any run with `tf_twobranch.runs.load_run`; the
system that wrote it (`tf_twobranch.systems` registry, `System.export`) gives its `RunExport`
(`tf_twobranch.export.run_gallery`):

* image–sentence two-branch rows: the pipeline's `serving_inputs` (the backbone that computed the
  cached image features with the row's views, the fitted sentence encoder); a side whose features
  came from the user's files (or the precomp layout, or a random-init backbone) keeps feature
  inputs;
* region–phrase two-branch rows: the region–phrase export (no retrieval gallery: these rows rank
  boxes for a phrase);
* the dual path and N-pair localization: their exports take JPEG bytes and captions already;
* deep fragment embeddings: JPEG bytes + boxes through the run's kept CNN
  (`systems.fragments.pipeline.serving_image_cnn`), parse triplets for sentences.

The gallery is the run's evaluated split (image ids and ``<image>#<k>`` caption ids, embedded as
``evaluate`` embeds them), and/or a folder of JPEGs and a caption file, embedded with the
functions the export's ``retrieve_*`` signatures embed a query with, so that a gallery item sent
as a query is embedded as the gallery holds it.
"""
from __future__ import annotations

import pathlib
from typing import Sequence

from absl import logging

from tf_twobranch import systems
from tf_twobranch.errors import UserInputError
from tf_twobranch.export.retrieval_signatures import RetrievalGallery
from tf_twobranch.export.run_gallery import build_gallery, list_gallery_images
from tf_twobranch.run_folders import read_run_task
from tf_twobranch.runs import load_run

__all__ = ["export_run", "gallery_from_model"]


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
        a gallery the system's export cannot embed (feature inputs, no gallery), ...
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
    fe = systems.for_task(found[0].name).export(run, found[0].name)
    chosen = build_gallery(fe, gallery, gallery_images, gallery_captions)
    if chosen is not None:
        logging.info("gallery: %d images, %d captions", len(chosen.image_ids), len(chosen.caption_ids))
    return fe.write(pathlib.Path(export_dir), chosen, gallery_block)


def gallery_from_model(model, split, image_ids: Sequence[str], caption_ids: Sequence[str]) -> RetrievalGallery:
    """The `RetrievalGallery` an export's ``retrieve_*`` signatures rank: the items of `split`
    embedded by `model` exactly as its ``evaluate`` embeds them, by the gallery function of the
    model's system (`System.gallery`).

    Two-branch: the tower outputs (`split` an `EvaluationSplit` or a dict with ``image``, ``text``
    and ``caption_image``); dual path: the L2-normalised, flip-averaged embeddings; deep fragment
    embeddings: the fragments of ``model.embed_split``; N-pair: the normalised projected maps and
    token vectors (`split` an `NPairEvaluationSplit`). One id per image row and per caption.
    """
    return systems.for_model(model).gallery(model, split, image_ids, caption_ids)
