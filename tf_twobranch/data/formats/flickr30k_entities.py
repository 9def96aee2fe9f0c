"""Flickr30K Entities: sentence files (``Sentences/<id>.txt``) and box files (``Annotations/<id>.xml``).

Semantics follow the official Python parser ``flickr30k_entities_utils.py``
(BryanPlummer/flickr30k_entities) — the functions here return the same
sentences, words, phrases, chain ids, types, first-word indices and boxes —
but malformed input raises :class:`~tf_twobranch.errors.DataFormatError`
instead of being silently misread.

Sentence files: one caption per line; an annotated phrase is written
``[/EN#<chain id>/<type 1>/.../<type n> <word 1> ... <word m>]``.  Chain id
``0`` (type ``notvisual``) is the null chain.  Like the official parser:

* lines are split on ``\\n`` and whitespace; empty lines are skipped (they do
  not count as sentences) but whitespace-only lines give an empty sentence;
* the ``[/EN#...`` token is not a word; the phrase ends at the first later
  token ending in ``]`` (that ``]`` is dropped); a token starting with ``[``
  inside a phrase is an ordinary word;
* ``first_word_index`` counts words of the bracket-free sentence.

Stricter than the official parser (which silently drops or garbles these):
a phrase not closed on its line, a ``]`` outside a phrase, an opening token
that is not ``[/EN#<digits>/<type>...``, a nested ``[/EN#`` opener and a
phrase without words raise DataFormatError naming the file and line.

Annotation files are PASCAL-VOC-like XML::

    <annotation>
    \\t<filename>1000092795.jpg</filename>
    \\t<size><width>333</width><height>500</height><depth>3</depth></size>
    \\t<object><name>1</name><name>6</name>
    \\t\\t<bndbox><xmin>197</xmin><ymin>110</ymin><xmax>261</xmax><ymax>373</ymax></bndbox>
    \\t</object>
    \\t<object><name>10</name><scene>0</scene><nobndbox>1</nobndbox></object>
    </annotation>

An object with several ``<name>`` tags gives its box to each of those chains;
a chain with several boxes is a plural entity.  XML coordinates are 1-based
and inclusive; like the official parser we subtract 1 from all four, giving
0-based inclusive boxes (the convention of :mod:`tf_twobranch.boxes`).
Objects without ``<bndbox>`` carry ``<nobndbox>`` and ``<scene>`` flags.
"""
from __future__ import annotations

import dataclasses
import os
import re
import xml.etree.ElementTree as ET
from typing import Iterable

import numpy as np

from tf_twobranch.boxes import validate_boxes
from tf_twobranch.data.formats._common import read_text
from tf_twobranch.data.formats.splits import read_split_file
from tf_twobranch.errors import DataFormatError

NULL_CHAIN_ID = "0"
NOTVISUAL_TYPE = "notvisual"

_OPENER = re.compile(r"^\[/EN#(?P<chain>[^/\s\[\]]*)(?P<types>(?:/[^/\s\[\]]*)*)$")


@dataclasses.dataclass
class Phrase:
    """One annotated phrase of a sentence.

    Attributes:
      first_word_index: 0-based position of the phrase's first word in
        ``EntitySentence.words``.
      text: the phrase's words joined by single spaces.
      chain_id: coreference chain id as a string ("0" = not visual).
      phrase_types: coarse types, e.g. ["people"] or ["people", "other"].
    """

    first_word_index: int
    text: str
    chain_id: str
    phrase_types: list[str]

    @property
    def num_words(self) -> int:
        return len(self.text.split(" "))


@dataclasses.dataclass
class EntitySentence:
    """A caption with its annotated phrases.

    ``line`` is the 1-based line of the sentence file it came from (None when
    built in memory); it is ignored in comparisons.
    """

    text: str
    words: list[str]
    phrases: list[Phrase]
    line: int | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class ImageAnnotation:
    """Boxes of one image.

    Attributes:
      width, height, depth: image size from ``<size>``.
      boxes: chain id -> float32 (k, 4) boxes [x1, y1, x2, y2], 0-based inclusive.
      scene_chains: chain ids of objects flagged ``<scene>1</scene>``.
      nobox_chains: chain ids of objects flagged ``<nobndbox>1</nobndbox>``.
    """

    width: int
    height: int
    depth: int
    boxes: dict[str, np.ndarray]
    scene_chains: list[str]
    nobox_chains: list[str]

    def __eq__(self, other):
        if not isinstance(other, ImageAnnotation):
            return NotImplemented
        return ((self.width, self.height, self.depth, self.scene_chains, self.nobox_chains)
                == (other.width, other.height, other.depth, other.scene_chains, other.nobox_chains)
                and list(self.boxes) == list(other.boxes)
                and all(np.array_equal(self.boxes[k], other.boxes[k]) for k in self.boxes))


@dataclasses.dataclass
class ImagePhrases:
    """Sentences and annotation of one Flickr30K Entities image."""

    image_id: str
    sentences: list[EntitySentence]
    annotation: ImageAnnotation
    sentence_path: str
    annotation_path: str


# ----------------------------------------------------------------------------
# Sentences


def parse_sentence_line(line: str, *, path="<string>", line_number: int | None = None) -> EntitySentence:
    """Parses one caption with ``[/EN#...]`` markup (see the module docstring)."""
    words: list[str] = []
    phrases: list[Phrase] = []
    current_words: list[str] = []
    open_phrase: tuple[int, str, list[str]] | None = None

    def fail(message: str):
        raise DataFormatError(path, f"{message}; expected phrases written as "
                                    f"'[/EN#<chain id>/<type>[/<type>...] word ...]' in {line.strip()!r}",
                              line=line_number)

    for token in line.split():
        if open_phrase is not None:
            if token.startswith("[/EN#"):
                fail(f"nested phrase annotation {token!r} inside an open phrase")
            if token.endswith("]"):
                token = token[:-1]
                current_words.append(token)
                words.append(token)
                first_word, chain_id, types = open_phrase
                phrases.append(Phrase(first_word, " ".join(current_words), chain_id, types))
                open_phrase = None
                current_words = []
            else:
                current_words.append(token)
                words.append(token)
        elif token.startswith("["):
            match = _OPENER.match(token)
            if match is None:
                if token.endswith("]"):
                    fail(f"phrase opener {token!r} has no words")
                fail(f"bad phrase opener {token!r}")
            chain_id = match.group("chain")
            if not chain_id.isdigit() or not chain_id.isascii():
                fail(f"bad chain id {chain_id!r} in {token!r} (expected a non-negative integer)")
            types = match.group("types").split("/")[1:]
            if not types or any(not t for t in types):
                fail(f"phrase opener {token!r} needs one or more non-empty types")
            open_phrase = (len(words), chain_id, types)
        elif token.endswith("]"):
            fail(f"unbalanced bracket: {token!r} closes a phrase that was never opened")
        else:
            words.append(token)
    if open_phrase is not None:
        fail("unbalanced bracket: a phrase is not closed by ']' before the end of the line")
    return EntitySentence(" ".join(words), words, phrases, line=line_number)


def read_sentence_file(path) -> list[EntitySentence]:
    """Reads ``Sentences/<image id>.txt`` into one EntitySentence per non-empty line."""
    if not os.path.exists(path):
        raise DataFormatError(path, "sentence file not found (expected Sentences/<image id>.txt)")
    sentences = []
    # Universal newlines, as Python's text mode reads them: files saved on Windows end in CRLF.
    text = read_text(path).replace("\r\n", "\n").replace("\r", "\n")
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line:
            continue
        sentences.append(parse_sentence_line(line, path=path, line_number=line_number))
    return sentences


def format_sentence(sentence: EntitySentence) -> str:
    """The ``[/EN#...]`` markup line for ``sentence`` (inverse of parse_sentence_line)."""
    opening: dict[int, str] = {}
    closing: set[int] = set()
    position = 0
    for phrase in sorted(sentence.phrases, key=lambda p: p.first_word_index):
        length = phrase.num_words
        start = phrase.first_word_index
        if start < position:
            raise ValueError(f"phrases overlap at word {start} in {sentence.text!r}")
        if sentence.words[start:start + length] != phrase.text.split(" "):
            raise ValueError(f"phrase {phrase.text!r} does not match words {start}..{start + length - 1} "
                             f"of {sentence.text!r}")
        if not phrase.phrase_types:
            raise ValueError(f"phrase {phrase.text!r} has no types")
        opening[start] = f"[/EN#{phrase.chain_id}/" + "/".join(phrase.phrase_types)
        closing.add(start + length - 1)
        position = start + length
    tokens = []
    for index, word in enumerate(sentence.words):
        if index in opening:
            tokens.append(opening[index])
        tokens.append(word + "]" if index in closing else word)
    return " ".join(tokens)


def write_sentence_file(path, sentences: Iterable[EntitySentence]) -> None:
    """Writes a sentence file in the official layout (one line per caption, '\\n' endings)."""
    lines = [format_sentence(sentence) for sentence in sentences]
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.write("".join(line + "\n" for line in lines))


# ----------------------------------------------------------------------------
# Annotations


def _child_text(element, tag: str, path, context: str) -> str:
    child = element.find(tag)
    if child is None or child.text is None or not child.text.strip():
        raise DataFormatError(path, f"missing <{tag}> in {context}")
    return child.text.strip()


def _child_int(element, tag: str, path, context: str) -> int:
    text = _child_text(element, tag, path, context)
    try:
        value = float(text)
    except ValueError:
        raise DataFormatError(path, f"<{tag}> in {context} is {text!r}, expected an integer") from None
    if not np.isfinite(value) or value != int(value):
        raise DataFormatError(path, f"<{tag}> in {context} is {text!r}, expected an integer")
    return int(value)


def read_annotation_file(path, *, clip: bool = False) -> ImageAnnotation:
    """Reads ``Annotations/<image id>.xml``.

    Boxes are converted to 0-based inclusive coordinates (XML value − 1) and
    validated: a box outside the image or with x2 < x1 / y2 < y1 raises
    DataFormatError naming the file and chain id.  With ``clip=True`` boxes
    that stick out of the image are clipped instead (degenerate boxes still
    raise).
    """
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        raise DataFormatError(path, "annotation file not found (expected Annotations/<image id>.xml)") from None
    except ET.ParseError as error:
        line = error.position[0] if getattr(error, "position", None) else None
        raise DataFormatError(path, f"malformed XML: {error}", line=line) from None
    size = root.find("size")
    if size is None:
        raise DataFormatError(path, "missing <size> with <width>, <height>, <depth>")
    width = _child_int(size, "width", path, "<size>")
    height = _child_int(size, "height", path, "<size>")
    depth_element = size.find("depth")
    depth = _child_int(size, "depth", path, "<size>") if depth_element is not None else 3
    if width <= 0 or height <= 0:
        raise DataFormatError(path, f"image size {width}x{height} must be positive")

    boxes: dict[str, list[list[int]]] = {}
    scene: list[str] = []
    nobox: list[str] = []
    for object_index, obj in enumerate(root.findall("object")):
        names = [(n.text or "").strip() for n in obj.findall("name")]
        context = f"<object> #{object_index + 1} (chains {names})"
        if any(not name for name in names):
            raise DataFormatError(path, f"empty <name> in {context}", record=f"object {object_index + 1}")
        bndbox = obj.find("bndbox")
        if bndbox is not None:
            coordinates = [_child_int(bndbox, tag, path, f"<bndbox> of {context}") - 1
                           for tag in ("xmin", "ymin", "xmax", "ymax")]
            for name in names:
                boxes.setdefault(name, []).append(coordinates)
        else:
            if obj.find("nobndbox") is None or obj.find("scene") is None:
                raise DataFormatError(path, f"{context} has neither <bndbox> nor <nobndbox>/<scene> flags",
                                      record=f"object {object_index + 1}")
            nobox_flag = _child_int(obj, "nobndbox", path, context)
            scene_flag = _child_int(obj, "scene", path, context)
            for name in names:
                if nobox_flag > 0:
                    nobox.append(name)
                if scene_flag > 0:
                    scene.append(name)

    box_arrays: dict[str, np.ndarray] = {}
    for chain_id, chain_boxes in boxes.items():
        array = np.asarray(chain_boxes, dtype=np.float32)
        if clip:
            # Degenerate boxes are reported before clipping could hide them.
            if (array[:, 2] < array[:, 0]).any() or (array[:, 3] < array[:, 1]).any():
                validate_boxes(array, path=path, record=f"chain {chain_id}")
            array[:, [0, 2]] = np.clip(array[:, [0, 2]], 0, width - 1)
            array[:, [1, 3]] = np.clip(array[:, [1, 3]], 0, height - 1)
        box_arrays[chain_id] = validate_boxes(array, width, height, path=path, record=f"chain {chain_id}")
    return ImageAnnotation(width, height, depth, box_arrays, scene, nobox)


def _format_int(value: float) -> str:
    return str(int(round(float(value))))


def write_annotation_file(path, annotation: ImageAnnotation, image_filename: str) -> None:
    """Writes ``annotation`` as Flickr30K Entities XML (tab-indented, like the released files).

    Boxes must hold integer pixel coordinates (they are written +1, 1-based).
    Boxes with identical coordinates are written as one ``<object>`` listing
    all their chains, as in the released files.
    """
    objects: list[tuple[list[str], tuple[int, ...]]] = []
    by_box: dict[tuple[int, ...], int] = {}
    for chain_id, chain_boxes in annotation.boxes.items():
        for box in np.asarray(chain_boxes).reshape(-1, 4):
            key = tuple(int(round(float(v))) for v in box)
            index = by_box.get(key)
            if index is not None and chain_id not in objects[index][0]:
                objects[index][0].append(chain_id)
            else:
                by_box[key] = len(objects)
                objects.append(([chain_id], key))
    flag_chains = list(dict.fromkeys(list(annotation.scene_chains) + list(annotation.nobox_chains)))

    lines = ["<annotation>", f"\t<filename>{_escape(image_filename)}</filename>", "\t<size>",
             f"\t\t<width>{int(annotation.width)}</width>", f"\t\t<height>{int(annotation.height)}</height>",
             f"\t\t<depth>{int(annotation.depth)}</depth>", "\t</size>"]
    for names, box in objects:
        lines.append("\t<object>")
        lines.extend(f"\t\t<name>{_escape(name)}</name>" for name in names)
        lines.append("\t\t<bndbox>")
        for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), box):
            lines.append(f"\t\t\t<{tag}>{value + 1}</{tag}>")
        lines.append("\t\t</bndbox>")
        lines.append("\t</object>")
    for chain_id in flag_chains:
        lines.append("\t<object>")
        lines.append(f"\t\t<name>{_escape(chain_id)}</name>")
        lines.append(f"\t\t<scene>{int(chain_id in annotation.scene_chains)}</scene>")
        lines.append(f"\t\t<nobndbox>{int(chain_id in annotation.nobox_chains)}</nobndbox>")
        lines.append("\t</object>")
    lines.append("</annotation>")
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.write("\n".join(lines) + "\n")


def _escape(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ----------------------------------------------------------------------------
# Dataset


def read_entities_dataset(root, split_ids, *, clip: bool = False) -> list[ImagePhrases]:
    """Reads ``root/Sentences/<id>.txt`` and ``root/Annotations/<id>.xml`` for each id.

    Args:
      root: Flickr30K Entities folder holding ``Sentences/`` and ``Annotations/``.
      split_ids: iterable of image ids, or the path of a split file (``test.txt``,
        read with :func:`tf_twobranch.data.formats.splits.read_split_file`).
      clip: passed to :func:`read_annotation_file`.
    """
    root = os.fspath(root)
    if isinstance(split_ids, (str, os.PathLike)):
        split_ids = read_split_file(split_ids)
    for folder in ("Sentences", "Annotations"):
        if not os.path.isdir(os.path.join(root, folder)):
            raise DataFormatError(root, f"missing folder {folder}/ (expected Sentences/ and Annotations/ "
                                        "of Flickr30K Entities)")
    images = []
    for image_id in split_ids:
        image_id = str(image_id).strip()
        sentence_path = os.path.join(root, "Sentences", f"{image_id}.txt")
        annotation_path = os.path.join(root, "Annotations", f"{image_id}.xml")
        images.append(ImagePhrases(image_id, read_sentence_file(sentence_path),
                                   read_annotation_file(annotation_path, clip=clip),
                                   sentence_path, annotation_path))
    return images
