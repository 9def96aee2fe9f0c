"""A small CUHK-PEDES-format person-search dataset derived from the embedded digit scenes.

The language-based person search protocol (Zheng et al. §6.1, after Li et
al. 2017) needs *identities*: several images of the same person, each with
two descriptions, and a split by identity ("the last 1,000 persons" for
evaluation). `generate_embedded_pedes` derives one, deterministically and in
seconds, from the embedded dataset (`tf_twobranch.data.embedded`), so the
protocol runs out of the box:

* identity = the scene's content, the multiset of (digit, colour) objects
  read from ``scenes.json`` (position, size, handwriting and background vary
  between the images of an identity, as pose and camera do for a person);
* identities with fewer than ``min_images_per_identity`` images are left out
  and at most ``max_images_per_identity`` images are kept per identity
  (defaults 2 and 4: about 3 images per identity, CUHK-PEDES has 3.1);
* two captions per image, as CUHK-PEDES: the caption that mentions every
  object (found from the Flickr30K Entities ``Sentences/`` markup; the
  longest caption when the dataset has no entities) and the next most
  complete one;
* identities are numbered 1.. in order of first appearance; the last ones go
  to test, the ones before to val (``test_fraction``, ``val_fraction``);
* images are hard-linked (copied where links are impossible) into
  ``imgs/digit_scenes/<image id>.jpg``; ``file_path`` is relative to ``imgs/``
  as in CUHK-PEDES (``reid_raw.json`` sits beside ``imgs/``).

Written with `tf_twobranch.data.formats.cuhk_pedes.write_cuhk_pedes`; read it
with `read_cuhk_pedes` or `tf_twobranch.systems.dual_path.data.dual_path_data_from_pedes`.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.embedded import MANIFEST_NAME as SOURCE_MANIFEST
from tf_twobranch.data.embedded import (SCENES_FILE_NAME, TOKEN_FILE_NAME, default_dataset_dir,
                                        load_embedded_dataset)
from tf_twobranch.data.formats.cuhk_pedes import PedesSplit, write_cuhk_pedes
from tf_twobranch.data.formats.flickr30k_entities import read_sentence_file
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.errors import ConfigError, DataFormatError

FORMAT_VERSION = 1
DATASET_NAME = "digit_pedes"
ANNOTATION_NAME = "reid_raw.json"
MANIFEST_NAME = "MANIFEST.json"
IMAGES_SUBDIR = "imgs"
CAMERA_DIR = "digit_scenes"  # like CUHK01/, CUHK03/, ... in CUHK-PEDES
CAPTIONS_PER_IMAGE = 2


def default_pedes_dir() -> pathlib.Path:
    """``digit_pedes`` beside the embedded dataset's default folder."""
    return default_dataset_dir().parent / DATASET_NAME


def _identity_key(scene: dict) -> tuple:
    return tuple(sorted((int(o["digit"]), str(o["colour"])) for o in scene["objects"]))


def _caption_order(source: pathlib.Path, scene: dict, captions: list[str]) -> list[int]:
    """Caption indices, most complete first (all entities mentioned)."""
    sentence_path = source / "Sentences" / f"{scene['id']}.txt"
    chains = {str(e["chain_id"]) for e in scene.get("entities", [])}
    if chains and sentence_path.is_file():
        sentences = read_sentence_file(sentence_path)
        if len(sentences) == len(captions):
            covered = [len(chains & {p.chain_id for p in s.phrases}) for s in sentences]
            return sorted(range(len(captions)), key=lambda k: (-covered[k], -len(captions[k]), k))
    return sorted(range(len(captions)), key=lambda k: (-len(captions[k].split()), k))


def _read_source(source: pathlib.Path):
    scenes_path = source / SCENES_FILE_NAME
    if not scenes_path.is_file():
        raise DataFormatError(scenes_path, "scenes.json of the embedded dataset is missing; "
                              "regenerate it with python -m tf_twobranch.data.embedded --force")
    with open(scenes_path, encoding="utf-8") as handle:
        scenes = json.load(handle)
    if not isinstance(scenes, dict) or not isinstance(scenes.get("images"), list):
        raise DataFormatError(scenes_path, "expected {'images': [scene records]}")
    corpus = read_token_file(source / TOKEN_FILE_NAME)
    return scenes["images"], corpus


def _parameters(min_images_per_identity, max_images_per_identity, val_fraction, test_fraction):
    if not 1 <= min_images_per_identity <= max_images_per_identity:
        raise ConfigError(f"need 1 <= min_images_per_identity <= max_images_per_identity, got "
                          f"{min_images_per_identity}, {max_images_per_identity}")
    if not (0 <= val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ConfigError(f"val_fraction and test_fraction must be in [0, 1) with a non-empty "
                          f"train split, got {val_fraction}, {test_fraction}")
    return {"min_images_per_identity": int(min_images_per_identity),
            "max_images_per_identity": int(max_images_per_identity),
            "val_fraction": float(val_fraction), "test_fraction": float(test_fraction)}


def _read_manifest(directory: pathlib.Path) -> dict | None:
    try:
        with open(directory / MANIFEST_NAME, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _link_or_copy(src: pathlib.Path, dst: pathlib.Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _write(directory: pathlib.Path, source: pathlib.Path, parameters: dict) -> dict:
    scenes, corpus = _read_source(source)
    groups: dict[tuple, list[dict]] = {}
    for scene in scenes:
        groups.setdefault(_identity_key(scene), []).append(scene)
    kept = [members[:parameters["max_images_per_identity"]] for members in groups.values()
            if len(members) >= parameters["min_images_per_identity"]]
    if len(kept) < 3:
        raise ConfigError(f"only {len(kept)} identities have >= "
                          f"{parameters['min_images_per_identity']} images in {source}; "
                          "lower min_images_per_identity or use a larger embedded dataset")
    num_test = max(1, int(round(len(kept) * parameters["test_fraction"])))
    num_val = int(round(len(kept) * parameters["val_fraction"]))
    if len(kept) - num_test - num_val < 1:
        raise ConfigError(f"{len(kept)} identities leave no training identity")
    split_of = ["train"] * (len(kept) - num_test - num_val) + ["val"] * num_val + ["test"] * num_test

    images_dir = directory / IMAGES_SUBDIR / CAMERA_DIR
    images_dir.mkdir(parents=True)
    pairs = {s: [] for s in ("train", "val", "test")}
    identities = {s: [] for s in ("train", "val", "test")}
    for identity, (members, split) in enumerate(zip(kept, split_of), start=1):
        for scene in members:
            image_id = str(scene["id"])
            if image_id not in corpus:
                raise DataFormatError(corpus.source, "image of scenes.json has no captions",
                                      record=image_id)
            captions = corpus.captions_of(image_id)
            if len(captions) < CAPTIONS_PER_IMAGE:
                raise DataFormatError(corpus.source, f"image has {len(captions)} captions, "
                                      f"need {CAPTIONS_PER_IMAGE}", record=image_id)
            order = _caption_order(source, scene, captions)
            file_path = f"{CAMERA_DIR}/{image_id}.jpg"
            src = source / "images" / f"{image_id}.jpg"
            if not src.is_file():
                raise DataFormatError(src, "image of the embedded dataset is missing",
                                      record=image_id)
            _link_or_copy(src, images_dir / f"{image_id}.jpg")
            pairs[split] += [(file_path, captions[k]) for k in order[:CAPTIONS_PER_IMAGE]]
            identities[split].append(identity)
    splits = {}
    for split in ("train", "val", "test"):
        if not pairs[split]:
            continue
        split_corpus = CaptionCorpus.from_pairs(pairs[split], source=str(directory / ANNOTATION_NAME))
        splits[split] = PedesSplit(split_corpus, np.asarray(identities[split], np.int64))
    write_cuhk_pedes(directory / ANNOTATION_NAME, splits)
    return {"identities": {s: len(set(identities[s])) for s in identities},
            "images": {s: len(identities[s]) for s in identities}}


def generate_embedded_pedes(out_dir: str | os.PathLike | None = None, *,
                            source_dir: str | os.PathLike | None = None,
                            min_images_per_identity: int = 2, max_images_per_identity: int = 4,
                            val_fraction: float = 0.1, test_fraction: float = 0.2,
                            force: bool = False) -> pathlib.Path:
    """Derives the digit person-search dataset (idempotent, atomic); returns its folder.

    Args:
      out_dir: target folder (default `default_pedes_dir()`).
      source_dir: the embedded digit-scene dataset; default
        `load_embedded_dataset()` (generated on first use).
      min_images_per_identity, max_images_per_identity: identity filter / cap.
      val_fraction, test_fraction: shares of identities for val and test
        (the last identities are test, the ones before them val).
      force: rebuild even when an up-to-date dataset exists.

    The folder holds ``reid_raw.json``, ``imgs/digit_scenes/*.jpg`` and
    ``MANIFEST.json`` (parameters and the source's manifest; a change of
    either triggers a rebuild).
    """
    parameters = _parameters(min_images_per_identity, max_images_per_identity, val_fraction,
                             test_fraction)
    source = pathlib.Path(source_dir) if source_dir is not None else load_embedded_dataset(with_proposals=False)
    source = source.absolute()
    source_manifest = _read_manifest(source) if (source / SOURCE_MANIFEST).is_file() else None
    expected = {"format_version": FORMAT_VERSION, "dataset": DATASET_NAME,
                "generator": "tf_twobranch.data.embedded_pedes", "parameters": parameters,
                "source_manifest": source_manifest}
    out_dir = pathlib.Path(out_dir) if out_dir is not None else default_pedes_dir()
    out_dir = out_dir.absolute()
    existing = _read_manifest(out_dir)
    if not force and existing is not None and \
            {k: existing.get(k) for k in expected} == expected and \
            (out_dir / ANNOTATION_NAME).is_file():
        return out_dir
    if out_dir.exists() and existing is None and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} is not empty and has no {MANIFEST_NAME} from "
                          "tf_twobranch.data.embedded_pedes; refusing to overwrite it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        summary = _write(partial, source, parameters)
        with open(partial / MANIFEST_NAME, "w", encoding="utf-8") as handle:
            json.dump({**expected, "source_dir": str(source), "summary": summary}, handle,
                      indent=2, sort_keys=True)
            handle.write("\n")
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
        partial.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


def load_embedded_pedes(out_dir: str | os.PathLike | None = None, **kwargs) -> pathlib.Path:
    """Path of the digit person-search ``reid_raw.json``, generating the dataset on first use.

    Keyword arguments are those of `generate_embedded_pedes`. Images are
    under ``<folder>/imgs`` (the images folder `tf_twobranch.data.layout.resolve_dataset`
    finds for a CUHK-PEDES folder).
    """
    return generate_embedded_pedes(out_dir, **kwargs) / ANNOTATION_NAME
