"""The layout of a dataset folder, recognised once: `resolve_dataset` -> `DatasetLayout`.

Every experiment hands its ``--dataset_dir`` (and the flags that override
parts of it) to `resolve_dataset` once, and passes the resulting
`DatasetLayout` to the readers, which take their files from it instead of
re-deriving them.

Captions (``caption_format="auto"``: the first match wins):

1. a Karpathy split file ``dataset_flickr30k.json`` / ``dataset_coco.json``
   (any ``dataset_*.json``): "karpathy";
2. a Flickr30K / Flickr8K caption file (``results_20130124.token``, any
   ``*.token`` or ``*.token.txt`` such as ``Flickr8k.token.txt``), split by
   the split lists below: "token";
3. MSCOCO caption files ``annotations/captions_{train,val,test}*.json``
   (one per split): "coco";
4. the vsepp/SCAN "precomp" layout: ``train_caps.txt`` and ``test_caps.txt``
   (or ``testall_caps.txt``), each beside its ``{split}_ims.npy`` image
   features; ``dev_caps.txt`` is the val split. When both ``testall`` and
   ``test`` exist (vsepp's ``coco_precomp``: the 5K test set and its first 1K
   images) the test split is ``testall``: "precomp";
5. a CUHK-PEDES annotation file ``reid_raw.json``: "cuhk_pedes".

A ``captions_path`` overrides the detection ("karpathy" for a ``.json``
file, else "token"); an explicit format is used as given. A folder with no
caption file still resolves (``caption_format`` None): phrase localization
with local word vectors and backbone weights needs none.

Beside the captions:

* split lists ``<root>/{train,val,test}.txt`` (Flickr30K Entities, one
  image id per line), else Flickr8K's ``Flickr_8k.{train,dev,test}Images.txt``,
  or ``split_files`` (for the "coco" format these are the per-split caption
  files instead);
* dependency parses of the captions in CoNLL-U: ``<caption file stem>.conllu``
  (``Flickr8k.token.conllu``) or ``<root>/captions.conllu`` (or None);
* Flickr30K Entities: the folder holding ``Annotations/`` and
  ``Sentences/`` (the dataset folder itself, or None);
* the images folder, found once: ``images_dir`` when given, else
  ``<root>/images``, ``<root>/flickr30k-images``, then ``<root>`` itself
  (CUHK-PEDES: ``<root>/imgs``, then ``<root>``);
* region proposals: ``proposals`` when given, else ``<root>/proposals.h5``
  (or None);
* whether the folder is the embedded dataset (its ``MANIFEST.json`` was
  written by `tf_twobranch.data.embedded` / `tf_twobranch.data.embedded_pedes`).

Image files follow one rule (`DatasetLayout.image_path`): in the images
folder, the file name given by the caption file (COCO), the id itself when
it is a file name (CUHK-PEDES ``file_path``), ``<id>.jpg`` / ``.jpeg`` /
``.png``, ``<id>``, then the COCO names ``train2014/COCO_train2014_<12-digit
id>.jpg`` (and ``val2014``, without the folder, and ``{train,val}2017/<12
digits>.jpg``).

A reader that needs pieces the folder lacks calls `DatasetLayout.require`,
which raises one `DataFormatError` naming the folder, what was found and what
is missing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Collection, Iterable, Mapping

from tf_twobranch.data.formats.precomp import PRECOMP_SPLITS, has_precomp_split
from tf_twobranch.data.formats.splits import read_split_file
from tf_twobranch.errors import DataFormatError, UserInputError

SPLITS = ("train", "val", "test")
CAPTION_FORMATS = ("auto", "karpathy", "token", "coco", "precomp", "cuhk_pedes")
#: What `DatasetLayout.require` can ask for: the caption file(s), a split
#: list, the images folder, the Flickr30K Entities folders, the proposals.
PIECES = ("captions", *SPLITS, "images", "entities", "proposals")
TOKEN_FILE_NAME = "results_20130124.token"
#: The Flickr8K release's split lists (``dev`` is the validation split).
FLICKR8K_SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt",
                        "test": "Flickr_8k.testImages.txt"}
PARSES_FILE_NAME = "captions.conllu"
PEDES_FILE_NAME = "reid_raw.json"
PROPOSALS_FILE_NAME = "proposals.h5"
MANIFEST_NAME = "MANIFEST.json"
#: Image folders tried in order (then the dataset folder itself).
IMAGE_FOLDERS = ("images", "flickr30k-images")
PEDES_IMAGE_FOLDERS = ("imgs",)
#: Suffixes tried after an image id.
IMAGE_FILE_SUFFIXES = (".jpg", ".jpeg", ".png")
_NO_CAPTIONS = ("no caption files found: expected dataset_*.json (Karpathy split), a *.token "
                "Flickr30K caption file with train/val/test.txt, annotations/captions_*.json "
                "(MSCOCO), the precomp layout (train_caps.txt and test_caps.txt / testall_caps.txt "
                "with {split}_ims.npy) or reid_raw.json (CUHK-PEDES)")


@dataclasses.dataclass(frozen=True)
class DatasetLayout:
    """What `resolve_dataset` found in a dataset folder (see the module docstring).

    Attributes:
      root: the dataset folder (None when only explicit files were given).
      caption_format: "karpathy", "token", "coco", "precomp", "cuhk_pedes",
        or None when the folder has no caption file.
      caption_file: the one caption file of the "karpathy", "token" and
        "cuhk_pedes" formats.
      split_caption_files: {split: caption file} of the "coco" (one JSON per
        split) and "precomp" (``{split}_caps.txt``) formats.
      precomp_splits: {package split: precomp split name} ("val" -> dev,
        "test" -> ``testall`` when present) of the "precomp" format.
      split_files: {split: split list file} (``train.txt`` etc.).
      images_dir: the images folder.
      entities_dir: the folder holding ``Annotations/`` and ``Sentences/``
        (Flickr30K Entities), or None.
      proposals: the region proposals file (or folder), or None.
      parses: the CoNLL-U dependency parses of the captions
        (``<caption file stem>.conllu``, e.g. ``Flickr8k.token.conllu``, or
        ``captions.conllu``), or None.
      embedded: the folder is the package's embedded dataset.
    """

    root: pathlib.Path | None
    caption_format: str | None
    caption_file: pathlib.Path | None = None
    split_caption_files: dict[str, pathlib.Path] = dataclasses.field(default_factory=dict)
    precomp_splits: dict[str, str] = dataclasses.field(default_factory=dict)
    split_files: dict[str, pathlib.Path] = dataclasses.field(default_factory=dict)
    images_dir: pathlib.Path | None = None
    entities_dir: pathlib.Path | None = None
    proposals: pathlib.Path | None = None
    parses: pathlib.Path | None = None
    embedded: bool = False

    # ------------------------------------------------------------------ pieces
    def has(self, piece: str) -> bool:
        """Whether the folder has `piece` (one of `PIECES`)."""
        if piece not in PIECES:
            raise UserInputError(f"unknown dataset piece {piece!r}; expected one of {PIECES}")
        if piece == "captions":
            if self.caption_format in ("coco", "precomp"):
                return all(s in self.split_caption_files and self.split_caption_files[s].is_file()
                           for s in ("train", "test"))
            return self.caption_file is not None and self.caption_file.is_file()
        if piece in SPLITS:
            return piece in self.split_files and self.split_files[piece].is_file()
        if piece == "images":
            return self.images_dir is not None and self.images_dir.is_dir()
        if piece == "entities":
            return self.entities_dir is not None
        return self.proposals is not None and self.proposals.exists()

    def require(self, *pieces: str, purpose: str) -> "DatasetLayout":
        """Returns self when every piece is there; else raises one DataFormatError
        naming the folder, the pieces found and the pieces missing.

        Args:
          pieces: names from `PIECES` ("captions", "train", "val", "test",
            "images", "entities", "proposals").
          purpose: what needs them (e.g. "phrase localization"), for the message.
        """
        missing = [name for piece in pieces if not self.has(piece) for name in self._expected(piece)]
        if not missing:
            return self
        found = self.found()
        raise DataFormatError(
            self.root if self.root is not None else "(no dataset folder)",
            f"not a complete dataset folder for {purpose}: found "
            f"{', '.join(found) if found else 'nothing it recognises'}; missing: {', '.join(missing)}")

    def found(self) -> list[str]:
        """The recognised pieces present, as the error messages name them."""
        items = []
        files = [self.caption_file] + [self.split_caption_files[s] for s in SPLITS
                                       if s in self.split_caption_files]
        files += [self.split_files[s] for s in SPLITS if s in self.split_files]
        for path in files:
            if path is not None and path.is_file() and self._show(path) not in items:
                items.append(self._show(path))
        if self.has("images"):
            count = _count_image_files(self.images_dir)
            items.append(f"{self._show(self.images_dir)}/ ({count:,} files)")
        if self.root is not None:
            items += [f"{name}/" for name in ("Annotations", "Sentences") if (self.root / name).is_dir()]
        if self.has("proposals"):
            items.append(self._show(self.proposals))
        return items

    def _expected(self, piece: str) -> list[str]:
        """What a missing piece would be called."""
        if piece == "captions":
            if self.caption_format is None:
                return [_NO_CAPTIONS]
            if self.caption_format == "coco":
                return [f"annotations/captions_{s}*.json" for s in ("train", "test")
                        if s not in self.split_caption_files or not self.split_caption_files[s].is_file()]
            if self.caption_format == "precomp":
                return [f"{name}_caps.txt" for s, name in self.precomp_splits.items() if s != "val"
                        and not (s in self.split_caption_files and self.split_caption_files[s].is_file())]
            if self.caption_file is not None:
                return [self._show(self.caption_file)]
            return {"karpathy": ["dataset_*.json"], "token": ["*.token"],
                    "cuhk_pedes": [PEDES_FILE_NAME]}[self.caption_format]
        if piece in SPLITS:
            return [self._show(self.split_files[piece]) if piece in self.split_files else f"{piece}.txt"]
        if piece == "images":
            return [f"images folder {self.images_dir}" if self.images_dir is not None
                    else "an images folder (images_dir)"]
        if piece == "entities":
            names = [f"{name}/" for name in ("Annotations", "Sentences")
                     if self.root is None or not (self.root / name).is_dir()]
            return names or ["Annotations/ and Sentences/"]
        return [self._show(self.proposals) if self.proposals is not None else PROPOSALS_FILE_NAME]

    def _show(self, path: pathlib.Path) -> str:
        """`path` relative to the dataset folder when inside it ("." for the folder itself)."""
        if self.root is not None:
            try:
                return pathlib.Path(path).relative_to(self.root).as_posix()
            except ValueError:
                pass
        return str(path)

    # ------------------------------------------------------------------ splits
    def split_ids(self, split: str, *, known_ids: Collection[str] | None = None) -> list[str]:
        """Image ids of the split list of `split`, in file order.

        Read with `tf_twobranch.data.formats.splits.read_split_file` (one id per
        line, image extensions stripped, repeated ids refused; `known_ids`:
        every id must be one of them).

        Raises:
          DataFormatError: the split file is missing, or lists no image ids.
        """
        path = self.split_files.get(split)
        if path is None or not path.is_file():
            where = path if path is not None else (self.root / f"{split}.txt" if self.root is not None
                                                   else f"{split}.txt")
            raise DataFormatError(where, f"split file missing: expected one image id per line for the "
                                  f"{split} split")
        ids = read_split_file(path, known_ids=known_ids)
        if not ids:
            # Caught here: downstream an empty split only shows up as a
            # feature file with "0 rows expected".
            raise DataFormatError(path, f"split file for '{split}' lists no image ids "
                                  "(expected one image id per line)")
        return ids

    # ------------------------------------------------------------------ images
    def image_path(self, image_id: str, *, file_name: str | None = None, source=None) -> pathlib.Path:
        """The absolute path of an image file (the one rule, see the module docstring).

        Args:
          image_id: the image id of the captions.
          file_name: the file name the caption file gives (COCO's ``file_name``).
          source: the file that lists the image, named in the error.
        Raises:
          DataFormatError: no candidate file exists; names `source` (default
            the caption file), the image and where it was looked for.
        """
        if self.images_dir is None:
            raise UserInputError(f"image {image_id!r}: no images folder (pass images_dir=...)")
        names = _image_file_names(str(image_id), file_name)
        for name in names:
            candidate = self.images_dir / name
            if candidate.is_file():
                return candidate.absolute()
        raise DataFormatError(source or self.caption_file or self.images_dir,
                              f"image file not found: looked for {names[0]} in {self.images_dir} "
                              "(pass images_dir=... if the images are elsewhere)",
                              record=f"image {image_id}")

    def image_paths(self, image_ids: Iterable[str], *, file_names: Mapping[str, str] | None = None,
                    source=None) -> list[pathlib.Path]:
        """`image_path` of every id (`file_names`: id -> file name given by the caption file)."""
        file_names = file_names or {}
        return [self.image_path(i, file_name=file_names.get(i), source=source) for i in image_ids]


def resolve_dataset(dataset_dir, *, caption_format: str = "auto", images_dir=None, captions_path=None,
                    split_files: Mapping[str, os.PathLike | str] | None = None,
                    proposals=None) -> DatasetLayout:
    """Recognises a dataset folder once (see the module docstring).

    Args:
      dataset_dir: the dataset folder (may be None with `captions_path`).
      caption_format: "auto", "karpathy", "token", "coco", "precomp" or "cuhk_pedes".
      images_dir: the images folder, instead of looking for one.
      captions_path: the caption file, instead of looking for one.
      split_files: {split: file}: split lists, instead of ``<root>/{split}.txt``
        (the "coco" format: the per-split caption files).
      proposals: the region proposals file/folder, instead of ``<root>/proposals.h5``.

    Raises:
      UserInputError: an unknown caption format, or explicit files that do not
        apply to the precomp layout.
      DataFormatError: `dataset_dir` does not exist.
    Nothing else is checked here: readers `DatasetLayout.require` what they need.
    """
    if caption_format not in CAPTION_FORMATS:
        raise UserInputError(f"caption format must be one of {CAPTION_FORMATS}, got {caption_format!r}")
    root = pathlib.Path(dataset_dir) if dataset_dir else None
    if root is not None and not root.is_dir():
        raise DataFormatError(root, "dataset directory does not exist")
    explicit = {s: pathlib.Path(p) for s, p in (split_files or {}).items() if p}
    fmt = _caption_format_of(root, caption_format, captions_path)
    caption_file, split_caption_files, precomp_splits = None, {}, {}
    if fmt == "precomp":
        if root is None:
            raise UserInputError("the precomp caption format needs a dataset directory")
        if captions_path is not None or explicit:
            raise UserInputError("captions_path/split_files do not apply to the precomp layout: "
                                 "its files are <dataset_dir>/{split}_caps.txt")
        precomp_splits = _precomp_names(root)
        for split, name in precomp_splits.items():
            path = next((root / f"{p}_caps.txt" for p in PRECOMP_SPLITS[name]
                         if (root / f"{p}_caps.txt").is_file()), None)
            if path is not None:
                split_caption_files[split] = path
    elif fmt == "coco":
        for split in SPLITS:
            path = explicit.get(split) or (_first(root.glob(f"annotations/captions_{split}*.json"))
                                           if root is not None else None)
            if path is not None:
                split_caption_files[split] = path
    elif captions_path is not None:
        caption_file = pathlib.Path(captions_path)
    elif root is not None and fmt == "karpathy":
        caption_file = _first(root.glob("dataset_*.json"))
    elif root is not None and fmt == "token":
        caption_file = (_first(root.glob(TOKEN_FILE_NAME)) or _first(root.glob("*.token"))
                        or _first(root.glob("*.token.txt")))
    elif root is not None and fmt == "cuhk_pedes" and (root / PEDES_FILE_NAME).is_file():
        caption_file = root / PEDES_FILE_NAME
    lists = {}
    for split in SPLITS:
        if fmt != "coco" and split in explicit:
            lists[split] = explicit[split]
        elif root is not None and (root / f"{split}.txt").is_file():
            lists[split] = root / f"{split}.txt"
        elif root is not None and (root / FLICKR8K_SPLIT_FILES[split]).is_file():
            lists[split] = root / FLICKR8K_SPLIT_FILES[split]
    if images_dir is not None:
        images = pathlib.Path(images_dir)
    elif root is not None:
        folders = PEDES_IMAGE_FOLDERS if fmt == "cuhk_pedes" else IMAGE_FOLDERS
        images = next((root / name for name in folders if (root / name).is_dir()), root)
    else:
        images = None
    entities = root if root is not None and all((root / name).is_dir()
                                                for name in ("Annotations", "Sentences")) else None
    if proposals:
        proposals_path = pathlib.Path(proposals)
    elif root is not None and (root / PROPOSALS_FILE_NAME).exists():
        proposals_path = root / PROPOSALS_FILE_NAME
    else:
        proposals_path = None
    return DatasetLayout(root=root, caption_format=fmt, caption_file=caption_file,
                         split_caption_files=split_caption_files, precomp_splits=precomp_splits,
                         split_files=lists, images_dir=images, entities_dir=entities,
                         proposals=proposals_path, parses=_parses_file(root, caption_file),
                         embedded=_is_embedded(root))


# ---------------------------------------------------------------------- helpers


def _parses_file(root: pathlib.Path | None, caption_file: pathlib.Path | None) -> pathlib.Path | None:
    """``<caption file stem>.conllu`` beside the caption file (``Flickr8k.token.txt`` ->
    ``Flickr8k.token.conllu``), else ``<root>/captions.conllu``."""
    candidates = []
    if caption_file is not None:
        name = caption_file.name[:-4] if caption_file.name.endswith(".txt") else caption_file.name
        candidates += [caption_file.with_name(name + ".conllu"),
                       caption_file.with_name(caption_file.stem + ".conllu")]
    if root is not None:
        candidates.append(root / PARSES_FILE_NAME)
    return next((c for c in candidates if c.is_file()), None)


def _first(paths):
    paths = sorted(paths)
    return paths[0] if paths else None


def _has_precomp_layout(root: pathlib.Path) -> bool:
    return has_precomp_split(root, "train") and (
        has_precomp_split(root, "testall") or has_precomp_split(root, "test"))


def _precomp_names(root: pathlib.Path) -> dict[str, str]:
    """{package split: precomp split}: train, val (dev, if present) and test
    (``testall`` when present, else ``test``)."""
    names = {"train": "train"}
    if has_precomp_split(root, "val"):
        names["val"] = "val"
    names["test"] = "testall" if has_precomp_split(root, "testall") else "test"
    return names


def _caption_format_of(root: pathlib.Path | None, caption_format: str, captions_path) -> str | None:
    if caption_format != "auto":
        return caption_format
    if captions_path is not None:
        return "karpathy" if pathlib.Path(captions_path).suffix == ".json" else "token"
    if root is None:
        return None
    if _first(root.glob("dataset_*.json")):
        return "karpathy"
    if _first(root.glob("*.token")) or _first(root.glob("*.token.txt")):
        return "token"
    if _first(root.glob("annotations/captions_*.json")):
        return "coco"
    if _has_precomp_layout(root):
        return "precomp"
    if (root / PEDES_FILE_NAME).is_file():
        return "cuhk_pedes"
    return None


def _is_embedded(root: pathlib.Path | None) -> bool:
    if root is None:
        return False
    try:
        with open(root / MANIFEST_NAME, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("generator", "")).startswith(
        "tf_twobranch.data.embedded")


def _coco_file_names(image_id: str) -> list[str]:
    if not image_id.isdigit():
        return []
    number = int(image_id)
    return [f"{sub}/COCO_{sub}_{number:012d}.jpg" for sub in ("train2014", "val2014")] + \
        [f"COCO_{sub}_{number:012d}.jpg" for sub in ("train2014", "val2014")] + \
        [f"{sub}/{number:012d}.jpg" for sub in ("train2017", "val2017")]


def _image_file_names(image_id: str, file_name: str | None) -> list[str]:
    """Candidate file names of an image, in the order they are tried."""
    names = [file_name] if file_name else []
    if pathlib.PurePosixPath(image_id).suffix:  # already a file name (CUHK-PEDES file_path)
        names.append(image_id)
    names += [f"{image_id}{suffix}" for suffix in IMAGE_FILE_SUFFIXES] + [image_id]
    names += _coco_file_names(image_id)
    return list(dict.fromkeys(names))


def _count_image_files(folder: pathlib.Path) -> int:
    suffixes = {*IMAGE_FILE_SUFFIXES, ".bmp", ".gif"}
    with os.scandir(folder) as entries:
        return sum(1 for e in entries if os.path.splitext(e.name)[1].lower() in suffixes)
