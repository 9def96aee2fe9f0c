"""In-memory caption corpus shared by every caption-file reader.

A `CaptionCorpus` holds the unique image ids of a dataset (in file order)
and its raw caption strings, grouped by image in image order, together with
the index of each caption's image.  All format readers in
`tf_twobranch.data.formats` return one, so the rest of the package never
depends on a particular on-disk layout.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Sequence

import numpy as np

from tf_twobranch.errors import DataFormatError


def split_fingerprint(image_ids: Sequence[str], captions: Sequence[str], caption_image) -> str:
    """A hash of a split's ordered image ids and its captions with their images.

    Two results are computed on the same split exactly when their
    fingerprints agree: another image order, a caption edited, moved to
    another image or dropped all change it. The text is hashed as UTF-8 with
    separators that cannot occur in an id or a caption line.
    """
    digest = hashlib.sha256()
    for image_id in image_ids:
        digest.update(str(image_id).encode("utf-8") + b"\x00")
    digest.update(b"\x01")
    for caption, image in zip(captions, np.asarray(caption_image).tolist()):
        digest.update(f"{image}\x1f{caption}".encode("utf-8") + b"\x00")
    return "sha256:" + digest.hexdigest()[:16]


@dataclasses.dataclass(eq=False)
class CaptionCorpus:
    """Captions grouped by image.

    Attributes:
      image_ids: unique image ids in order, without file extension
        (e.g. "1000092795").
      captions: raw caption strings, grouped by image in image order.
      caption_image: int32 array (num_captions,); index into `image_ids` of
        each caption's image (non-decreasing, because captions are grouped).
      source: the file the corpus was read from (used in error messages).
    """

    image_ids: list[str]
    captions: list[str]
    caption_image: np.ndarray
    source: str = ""

    def __post_init__(self):
        self.image_ids = list(self.image_ids)
        self.captions = list(self.captions)
        self.caption_image = np.asarray(self.caption_image, dtype=np.int32).reshape(-1)
        self.source = str(self.source)
        self._index: dict[str, int] | None = None

    def __eq__(self, other: object) -> bool:
        """Same contents; `source` (only used in messages) is not compared."""
        # The generated dataclass __eq__ would compare arrays element-wise.
        if type(other) is not type(self):
            return NotImplemented
        for field in dataclasses.fields(self):
            if field.name == "source":
                continue
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, np.ndarray) or isinstance(theirs, np.ndarray):
                if not np.array_equal(mine, theirs):
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # mutable

    # ------------------------------------------------------------ construction
    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]], source: str = "") -> "CaptionCorpus":
        """Builds a corpus from (image_id, caption) pairs.

        Images are ordered by first appearance; each image's captions keep
        their relative order, and are grouped together even when the pairs
        of one image are not adjacent.
        """
        grouped: dict[str, list[str]] = {}
        for image_id, caption in pairs:
            grouped.setdefault(image_id, []).append(caption)
        return cls._from_grouped(grouped, source)

    @classmethod
    def _from_grouped(cls, grouped: dict[str, list[str]], source: str) -> "CaptionCorpus":
        image_ids = list(grouped)
        captions: list[str] = []
        counts = np.empty(len(image_ids), dtype=np.int64)
        for i, image_id in enumerate(image_ids):
            image_captions = grouped[image_id]
            captions.extend(image_captions)
            counts[i] = len(image_captions)
        caption_image = np.repeat(np.arange(len(image_ids), dtype=np.int32), counts)
        return cls(image_ids, captions, caption_image, source)

    # -------------------------------------------------------------- properties
    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    def fingerprint(self) -> str:
        """`split_fingerprint` of this corpus (its ids, captions and their images, in order)."""
        return split_fingerprint(self.image_ids, self.captions, self.caption_image)

    def image_index(self, image_id: str) -> int:
        """Position of `image_id` in `image_ids`; KeyError when absent."""
        if self._index is None or len(self._index) != len(self.image_ids):
            self._index = {image_id: i for i, image_id in enumerate(self.image_ids)}
        try:
            return self._index[image_id]
        except KeyError:
            raise KeyError(f"image id {image_id!r} is not in the caption corpus "
                           f"{self.source or '(unnamed)'}") from None

    def __contains__(self, image_id: object) -> bool:
        try:
            self.image_index(image_id)  # type: ignore[arg-type]
        except KeyError:
            return False
        return True

    def captions_of(self, image_id: str) -> list[str]:
        """The captions of one image, in corpus order (KeyError if unknown)."""
        index = self.image_index(image_id)
        positions = np.flatnonzero(self.caption_image == index)
        return [self.captions[p] for p in positions]

    def captions_by_image(self) -> list[list[str]]:
        """The captions of every image, as a list parallel to `image_ids`."""
        result: list[list[str]] = [[] for _ in self.image_ids]
        for caption, index in zip(self.captions, self.caption_image.tolist()):
            result[index].append(caption)
        return result

    def captions_per_image(self) -> int | None:
        """The number of captions per image if it is the same for all images, else None."""
        if self.num_images == 0:
            return None
        counts = np.bincount(self.caption_image, minlength=self.num_images)
        return int(counts[0]) if np.all(counts == counts[0]) else None

    def positive_mask(self) -> np.ndarray:
        """Boolean (num_captions, num_images) matrix; True where caption i describes image j."""
        mask = np.zeros((self.num_captions, self.num_images), dtype=bool)
        mask[np.arange(self.num_captions), self.caption_image] = True
        return mask

    # ---------------------------------------------------------------- subsets
    def subset(self, image_ids: Sequence[str], *, source: str | None = None) -> "CaptionCorpus":
        """The corpus restricted to `image_ids`, in the given order.

        Args:
          image_ids: ids to keep (e.g. read from a split file).
          source: where `image_ids` came from (e.g. the split file); named in
            the error when an id is unknown or repeated.
        Raises:
          DataFormatError: an id is not in this corpus, or is repeated.
        """
        where = source if source is not None else self.source
        order = np.argsort(self.caption_image, kind="stable")  # robust to ungrouped input
        counts = np.bincount(self.caption_image, minlength=self.num_images)
        starts = np.concatenate([[0], np.cumsum(counts)])
        seen: set[str] = set()
        captions: list[str] = []
        new_counts = np.empty(len(image_ids), dtype=np.int64)
        for new_index, image_id in enumerate(image_ids):
            if image_id in seen:
                raise DataFormatError(where, f"image id {image_id!r} is listed twice", record=image_id)
            seen.add(image_id)
            try:
                index = self.image_index(image_id)
            except KeyError:
                raise DataFormatError(
                    where, f"image id {image_id!r} is not in the caption corpus "
                    f"{self.source or '(unnamed)'}", record=image_id) from None
            positions = order[starts[index]:starts[index + 1]]
            captions.extend(self.captions[p] for p in positions)
            new_counts[new_index] = len(positions)
        caption_image = np.repeat(np.arange(len(image_ids), dtype=np.int32), new_counts)
        return dataclasses.replace(self, image_ids=list(image_ids), captions=captions,
                                   caption_image=caption_image)

    # -------------------------------------------------------------- validation
    def validate(self) -> "CaptionCorpus":
        """Checks the invariants; returns self so calls can be chained.

        Raises DataFormatError naming `source` and the caption index / image id
        when: lengths disagree, an image id is empty or repeated, a caption
        index is out of range, captions are not grouped by image in image
        order, or a caption is empty.
        """
        source = self.source or "(unnamed corpus)"
        if len(self.caption_image) != len(self.captions):
            raise DataFormatError(source, f"{len(self.captions)} captions but "
                                  f"{len(self.caption_image)} caption-image indices")
        seen: dict[str, int] = {}
        for i, image_id in enumerate(self.image_ids):
            if not isinstance(image_id, str) or not image_id:
                raise DataFormatError(source, f"image {i} has an empty or non-string id {image_id!r}",
                                      record=image_id)
            if image_id in seen:
                raise DataFormatError(source, f"image id {image_id!r} occurs twice "
                                      f"(images {seen[image_id]} and {i})", record=image_id)
            seen[image_id] = i
        if self.num_captions:
            bad = np.flatnonzero((self.caption_image < 0) | (self.caption_image >= self.num_images))
            if bad.size:
                i = int(bad[0])
                raise DataFormatError(source, f"caption {i} refers to image index "
                                      f"{int(self.caption_image[i])}, but there are "
                                      f"{self.num_images} images", record=f"caption {i}")
            decreasing = np.flatnonzero(np.diff(self.caption_image) < 0)
            if decreasing.size:
                i = int(decreasing[0]) + 1
                raise DataFormatError(source, f"caption {i} (image "
                                      f"{self.image_ids[self.caption_image[i]]!r}) is out of order: "
                                      "captions must be grouped by image in image order",
                                      record=f"caption {i}")
        for i, caption in enumerate(self.captions):
            if not isinstance(caption, str) or not caption.strip():
                image_id = self.image_ids[self.caption_image[i]]
                raise DataFormatError(source, f"caption {i} of image {image_id!r} is empty",
                                      record=f"caption {i}")
        return self


def caption_keys(corpus: CaptionCorpus) -> list[str]:
    """``<image id>#<p>`` of every caption, p its position (from 0) among its image's captions."""
    keys, previous, k = [], -1, 0
    for image in corpus.caption_image:
        k = k + 1 if image == previous else 0
        previous = image
        keys.append(f"{corpus.image_ids[image]}#{k}")
    return keys
