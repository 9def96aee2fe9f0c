"""What a system's export of a finished run gives `export_run`, and the gallery it is built from.

A system's `export(run, task)` (`tf_twobranch.systems.registry.System`) returns a `RunExport`:
the run's evaluated split as a gallery (image ids and ``<image>#<k>`` caption ids, embedded as
``evaluate`` embeds them), a serving module whose query functions embed a folder of JPEGs or a
caption file as the export's ``retrieve_*`` signatures embed a query (`build_gallery`), and the
writer. The app `tf_twobranch.run_export.export_run` puts them together.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.data.formats._common import read_text
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
from tf_twobranch.errors import UserInputError
from tf_twobranch.export import serving
from tf_twobranch.data.corpus import caption_keys
from tf_twobranch.export.retrieval_signatures import RetrievalGallery

__all__ = ["RunExport", "build_gallery", "batched", "plain_captions", "caption_keys", "gallery_caption_ids",
           "read_gallery_captions", "list_gallery_images", "JPEG_SUFFIXES", "EMBED_BATCH"]

JPEG_SUFFIXES = (".jpg", ".jpeg")
# Gallery items per embedding call: bounds the memory of a folder's pass through the CNN.
EMBED_BATCH = 16
_TOKEN_LINE = re.compile(r"^[^\t]+#\d+\t")

@dataclasses.dataclass
class RunExport:
    """What `export_run` needs of a run (a system's `export` gives it): its evaluated split as a
    gallery, a serving module to embed user galleries with, the request inputs of image files and
    captions, and the writer."""
    system: str
    split_name: str | None                          # the split the run was evaluated on (None: no gallery)
    split_gallery: Callable[[], RetrievalGallery] | None
    module: Callable[[], tf.Module] | None          # the serving module without gallery
    write: Callable[[pathlib.Path, RetrievalGallery | None, int | None], pathlib.Path]
    image_inputs: Callable[[list[bytes]], tuple] = lambda jpegs: (jpegs,)
    text_inputs: Callable[[pathlib.Path], tuple[list[str], tuple]] | None = None
    no_image_gallery: str | None = None             # why a folder of JPEGs cannot be embedded
    no_caption_gallery: str | None = None           # why a caption file cannot be embedded
    no_gallery: str | None = None                   # why the run has no retrieval gallery at all


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


def batched(items: list, request: Callable[[list], tuple]) -> list[tuple]:
    return [request(items[i:i + EMBED_BATCH]) for i in range(0, len(items), EMBED_BATCH)]


def _user_side(fe: RunExport, module, images_dir=None, captions_file=None):
    """(ids, embeddings, mask) of a gallery folder of JPEGs or a caption file, embedded by the
    export's query functions (a tf.function of the signatures' input specs, as they run)."""
    image_specs, text_specs = module.query_specs
    if images_dir is not None:
        paths = list_gallery_images(images_dir)
        fn = serving.signature_function(*image_specs)(module.query_image)
        jpegs = [p.read_bytes() for p in paths]
        embeddings, mask = _embed(fn, batched(jpegs, fe.image_inputs), "image", images_dir)
        return [p.stem for p in paths], embeddings, mask
    ids, batches = fe.text_inputs(pathlib.Path(captions_file))
    fn = serving.signature_function(*text_specs)(module.query_text)
    embeddings, mask = _embed(fn, batches, "caption", captions_file)
    return ids, embeddings, mask


def build_gallery(fe: RunExport, gallery: str | None, images_dir=None, captions_file=None
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


def plain_captions(path: pathlib.Path) -> tuple[list[str], list[tuple]]:
    ids, captions = read_gallery_captions(path)
    return ids, batched(captions, lambda items: (items,))
