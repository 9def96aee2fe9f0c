"""The vsepp / SCAN "precomp" layout of precomputed retrieval data.

A folder (e.g. vsepp's ``data/f30k_precomp``, ``data/coco_precomp``, SCAN's
``data/f30k_precomp``) holds, per split::

    {split}_caps.txt   one caption per line; the captions of image i are
                       lines 5i+1 .. 5i+5 (5 per image, in image order)
    {split}_ims.npy    image features, one row per image: (N, D) global
                       features (vsepp) or (N, 36, D) region features
                       (SCAN's bottom-up-attention regions)

Split names: ``train``, ``dev`` (the validation split; ``val`` is accepted
and looks for ``dev_*`` first, then ``val_*``), ``test`` and ``testall``.
In vsepp's ``coco_precomp``, ``testall`` is the 5K test set and ``test``
its first 1K images; Flickr30K has ``test`` only.

Image rows (vsepp's ``im_div``): with N image rows and C captions,

* ``C == 5 N``: row i is image i (the usual case, vsepp's ``im_div = 5``);
* ``C == N``: some releases repeat each image's row once per caption
  (vsepp's ``im_div = 1``); image i is then row ``5 i`` (the first row of
  each group of 5).  The rows of a group are expected to be identical; a
  warning is logged when the first groups are not.

Anything else is a DataFormatError naming both files and both counts.

Region features: the two-branch models need one global vector per image,
so by default (package choice) the regions of an image are averaged:
(N, R, D) -> (N, D).  ``keep_regions=True`` returns the regions themselves,
always as (N, R, D) (a global (N, D) file gives (N, 1, D)), for
fragment-based models.

Image ids (the precomp layout has none): ``"{prefix}_{i}"``, where prefix
is the file prefix actually read (``train``, ``dev``, ``test``,
``testall``) and i the 0-based image index, e.g. ``"test_0"``.

Memory: the ``.npy`` file is memory-mapped and read in blocks.  When the
rows asked for are the file's own (a 2-D file, or a 3-D one with
``keep_regions``, one row per image, in the wanted dtype) the memory map
itself is returned; otherwise (regions averaged, one row per caption,
another dtype) the result is written block by block into a row-major
``.npy`` in a conversion cache (keyed by the file's path, size and
modification time; `features.conversion_cache_dir` unless a folder is
given) and that file is memory-mapped, so no whole array is ever held in
memory.  Every problem is a DataFormatError naming the file and the line
(captions) or record (image row).
"""
from __future__ import annotations

import os
import pathlib

import numpy as np
from absl import logging

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats._common import check_exists, read_text
from tf_twobranch.data.formats.features import conversion_path, returned_dtype
from tf_twobranch.data.formats.row_arrays import BLOCK_BYTES, RowWriter, open_rows
from tf_twobranch.errors import ConfigError, DataFormatError

CAPTIONS_PER_IMAGE = 5
# Split name -> file prefixes tried in order.
PRECOMP_SPLITS = {"train": ("train",), "val": ("dev", "val"), "dev": ("dev", "val"),
                  "test": ("test",), "testall": ("testall",)}
_IDENTITY_CHECK_IMAGES = 100  # groups of repeated rows compared for the im_div=1 warning


def _prefixes(split: str) -> tuple[str, ...]:
    if split not in PRECOMP_SPLITS:
        raise ConfigError(f"precomp split must be one of {sorted(PRECOMP_SPLITS)}, got {split!r}")
    return PRECOMP_SPLITS[split]


def precomp_split_paths(dataset_dir, split: str) -> tuple[pathlib.Path, pathlib.Path, str]:
    """(captions file, image features file, file prefix) of one split.

    For ``val``/``dev`` the first prefix whose captions file exists is used.
    Raises DataFormatError naming the missing file(s).
    """
    root = pathlib.Path(dataset_dir)
    prefixes = _prefixes(split)
    prefix = next((p for p in prefixes if (root / f"{p}_caps.txt").exists()), prefixes[0])
    caps, ims = root / f"{prefix}_caps.txt", root / f"{prefix}_ims.npy"
    if not caps.exists():
        looked = " or ".join(str(root / f"{p}_caps.txt") for p in prefixes)
        raise DataFormatError(caps, f"captions file of the precomp split {split!r} does not "
                              f"exist (looked for {looked})")
    if not ims.exists():
        raise DataFormatError(ims, f"image features file of the precomp split {split!r} does "
                              f"not exist (expected beside {caps.name}: (N, D) or (N, 36, D) "
                              "float array saved with numpy.save)")
    return caps, ims, prefix


def has_precomp_split(dataset_dir, split: str) -> bool:
    """Whether `dataset_dir` holds the captions file of `split` (e.g. ``test_caps.txt``)."""
    root = pathlib.Path(dataset_dir)
    return any((root / f"{p}_caps.txt").is_file() for p in _prefixes(split))


def read_precomp_captions_file(path: str | os.PathLike) -> list[str]:
    """The captions of a ``{split}_caps.txt`` file, one per line, stripped.

    Lines are separated by ``\\n`` only (as vsepp reads them), so line numbers
    match what an editor shows.  Blank lines at the end of the file are
    ignored; a blank line anywhere else would shift every later caption to
    the wrong image and is a DataFormatError with its line number, as is a
    file that is not UTF-8 or holds no captions.
    """
    path = os.fspath(path)
    lines = read_text(path).split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise DataFormatError(path, "holds no captions (expected one caption per line, "
                              f"{CAPTIONS_PER_IMAGE} per image in image order)")
    captions = []
    for line_number, line in enumerate(lines, start=1):
        caption = line.strip()
        if not caption:
            raise DataFormatError(path, "empty caption line (every line is one caption, "
                                  f"{CAPTIONS_PER_IMAGE} per image in image order; a blank line "
                                  "would shift the later captions to the wrong images)",
                                  line=line_number)
        captions.append(caption)
    return captions


def _npy_header(path: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from the .npy header; checks that the file is complete."""
    check_exists(path)
    fmt = np.lib.format
    try:
        with open(path, "rb") as f:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = fmt.read_array_header_2_0(f)
            offset = f.tell()
    except Exception as e:  # numpy raises ValueError/EOFError/... for damaged headers
        raise DataFormatError(path, f"is truncated or not a NumPy .npy file (bad header: "
                              f"{type(e).__name__}: {e}); expected an (N, D) or (N, 36, D) float "
                              "array saved with numpy.save") from None
    del fortran
    if dtype.hasobject or dtype.kind not in "iuf":
        raise DataFormatError(path, f"array has dtype {dtype}; expected a float array of shape "
                              "(N, D) or (N, 36, D)")
    if len(shape) not in (2, 3):
        raise DataFormatError(path, f"array has shape {shape}; expected a 2-D (N, D) global or "
                              "3-D (N, regions, D) region float array")
    if any(n == 0 for n in shape):
        raise DataFormatError(path, f"array has shape {shape}; expected at least one image row, "
                              "region and dimension")
    needed = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = os.path.getsize(path)
    if size < needed:
        raise DataFormatError(path, f"is truncated: its header declares a {dtype} array of shape "
                              f"{shape} ({needed} bytes with the header) but the file has only "
                              f"{size} bytes (was the download or copy interrupted?)")
    return tuple(int(n) for n in shape), dtype


def _row_step(caps_path: str, ims_path: str, num_captions: int, num_rows: int,
              captions_per_image: int) -> int:
    """Image i is row ``i * step``: 1 for one row per image, cpi for one row per caption."""
    cpi = captions_per_image
    if num_captions == cpi * num_rows:
        return 1
    if num_captions == num_rows:
        if num_captions % cpi:
            raise DataFormatError(caps_path, f"{num_captions} captions with as many image rows in "
                                  f"{ims_path} (one row per caption), but {num_captions} is not a "
                                  f"multiple of {cpi} captions per image")
        return cpi
    if num_captions % num_rows:
        what = f"is not a multiple of the {num_rows} image rows"
    else:
        what = f"is {num_captions // num_rows} per image row, not {cpi}"
    raise DataFormatError(caps_path, f"{num_captions} captions {what} in {ims_path} "
                          f"(expected {cpi} captions per image: {cpi} x {num_rows} = "
                          f"{cpi * num_rows} lines, or one image row per caption)")


def _corpus(captions: list[str], num_images: int, captions_per_image: int, prefix: str,
            source: str) -> CaptionCorpus:
    ids = [f"{prefix}_{i}" for i in range(num_images)]
    caption_image = np.repeat(np.arange(num_images, dtype=np.int32), captions_per_image)
    return CaptionCorpus(ids, captions, caption_image, source)


def read_precomp_corpus(dataset_dir, split: str, *,
                        captions_per_image: int = CAPTIONS_PER_IMAGE) -> CaptionCorpus:
    """The captions of one precomp split (only the header of ``{split}_ims.npy`` is read).

    Same checks as `read_precomp_split` except the feature values.
    """
    _check_cpi(captions_per_image)
    caps, ims, prefix = precomp_split_paths(dataset_dir, split)
    captions = read_precomp_captions_file(caps)
    shape, _ = _npy_header(str(ims))
    step = _row_step(str(caps), str(ims), len(captions), shape[0], captions_per_image)
    return _corpus(captions, shape[0] // step, captions_per_image, prefix, str(caps))


def _check_cpi(captions_per_image: int) -> None:
    if not isinstance(captions_per_image, (int, np.integer)) or captions_per_image < 1:
        raise ConfigError(f"captions_per_image must be a positive integer, "
                          f"got {captions_per_image!r}")


def _warn_if_groups_differ(stored, step: int, num_images: int, ims_path: str) -> None:
    for i in range(min(num_images, _IDENTITY_CHECK_IMAGES)):
        group = np.asarray(stored[i * step:(i + 1) * step])
        if not np.array_equal(group, np.broadcast_to(group[:1], group.shape)):
            logging.warning("%s: %d image rows for as many captions, but rows %d..%d (the "
                            "captions of image %d) differ; using the first row of each group "
                            "of %d as the image", ims_path, len(stored), i * step,
                            (i + 1) * step - 1, i, step)
            return


def read_precomp_split(dataset_dir, split: str, *, keep_regions: bool = False,
                       captions_per_image: int = CAPTIONS_PER_IMAGE, dtype: str | None = None,
                       cache_dir=None) -> tuple[CaptionCorpus, np.ndarray]:
    """Reads ``{split}_caps.txt`` and ``{split}_ims.npy`` of a precomp folder.

    Args:
      dataset_dir: the folder (e.g. ``data/f30k_precomp``).
      split: ``train``, ``dev``/``val``, ``test`` or ``testall``.
      keep_regions: False: (num_images, D), the regions of a 3-D file
        averaged (the package's choice for the global-vector models); True:
        the regions, (num_images, R, D) ((N, 1, D) for a 2-D file).
      captions_per_image: 5 (Flickr30K, MSCOCO).
      dtype: None: float32 (a float16 file used as it is stays float16);
        "float32" / "float16" (``--feature_dtype``): that dtype.
      cache_dir: where a converted array goes (module docstring).
    Returns:
      (corpus, image_features): image ids ``"{prefix}_{i}"`` (see the module
      docstring); feature row i belongs to ``corpus.image_ids[i]``.  The
      features are a read-only memory map: of the file itself when its rows
      are used as stored, else of the converted copy.
    Raises:
      DataFormatError naming the file and line/record: a missing file, an
      empty caption line, non-UTF-8 captions, a caption count that is not
      `captions_per_image` per image row (both files and counts named), an
      array that is not 2-D/3-D numeric, a truncated or damaged ``.npy``,
      NaN/inf values (first bad row).
      ConfigError: unknown split or dtype.
    """
    _check_cpi(captions_per_image)
    caps, ims, prefix = precomp_split_paths(dataset_dir, split)
    caps, ims = str(caps), str(ims)
    captions = read_precomp_captions_file(caps)
    shape, stored_dtype = _npy_header(ims)
    step = _row_step(caps, ims, len(captions), shape[0], captions_per_image)
    num_images = shape[0] // step
    corpus = _corpus(captions, num_images, captions_per_image, prefix, caps)
    try:
        stored = np.load(ims, mmap_mode="r", allow_pickle=False)
    except Exception as e:
        raise DataFormatError(ims, f"is not a readable NumPy .npy file ({type(e).__name__}: "
                              f"{e})") from None
    if step > 1:
        _warn_if_groups_differ(stored, step, num_images, ims)
    regions = stored.ndim == 3
    want = returned_dtype(stored_dtype, dtype)
    as_stored = None
    if step == 1 and stored_dtype == want:
        if keep_regions:
            as_stored = stored if regions else stored[:, None, :]
        elif not regions:
            as_stored = stored
    if as_stored is not None:
        for _ in _checked_blocks(stored, step, num_images, ims, corpus):
            pass
        return corpus, as_stored
    dim = shape[-1]
    out_shape = ((num_images, shape[1] if regions else 1, dim) if keep_regions
                 else (num_images, dim))
    target = conversion_path(ims, f"images.step{step}.{'regions' if keep_regions else 'mean'}",
                             want, cache_dir)
    if target.exists():
        cached = open_rows(target)
        if cached.shape == out_shape and cached.dtype == want:
            return corpus, cached  # checked when it was written
    with RowWriter(target, out_shape, want) as out:
        for lo, hi, values in _checked_blocks(stored, step, num_images, ims, corpus):
            if keep_regions:
                out[lo:hi] = values if regions else values[:, None, :]
            else:
                out[lo:hi] = values.mean(axis=1) if regions else values
    return corpus, open_rows(target)


def _checked_blocks(stored, step: int, num_images: int, ims: str, corpus: CaptionCorpus):
    """(first image, end image, their rows as float32) in blocks of about BLOCK_BYTES, each
    checked for NaN/inf (an error names the stored row and the image)."""
    rows = stored[::step] if step > 1 else stored
    row_bytes = int(np.prod(stored.shape[1:], dtype=np.int64)) * 4
    block = max(1, BLOCK_BYTES // row_bytes)
    for lo in range(0, num_images, block):
        hi = min(num_images, lo + block)
        try:
            values = np.asarray(rows[lo:hi], dtype=np.float32)
        except Exception as e:  # I/O errors of the memory map
            raise DataFormatError(ims, f"could not be read ({type(e).__name__}: {e})") from None
        finite = np.isfinite(values).reshape(hi - lo, -1).all(axis=1)
        if not finite.all():
            image = lo + int(np.flatnonzero(~finite)[0])
            raise DataFormatError(ims, f"NaN/inf values in image row {image * step} (image "
                                  f"{image}, {corpus.image_ids[image]!r}); expected finite "
                                  "features", record=f"row {image * step}")
        yield lo, hi, values
