"""Word-vector files: reading and writing word2vec/GloVe files.

Supported on-disk layouts (detected from the file content, not the name):

* word2vec binary (the layout of ``GoogleNews-vectors-negative300.bin``):
  an ASCII header ``"V D\\n"``, then for every word: the word's UTF-8 bytes, a
  space, ``D`` little-endian float32 values, and an optional newline.
* word2vec text: the same header line, then one line ``word v1 ... vD`` per word.
* GloVe text: no header, one line ``word v1 ... vD`` per word.

Any of these may be gzip-compressed (detected from the magic bytes) and may
start with a UTF-8 byte-order mark. A GloVe word may contain spaces
(glove.840B has a few); one whose last piece is a number cannot be told from a
row with too many numbers and is refused.

No vectors are ever downloaded: pass a local path, or train count-based
vectors on your own captions with `tf_twobranch.features.word_vectors.train_word_vectors`.
"""
from __future__ import annotations

import codecs
import gzip
import io
import logging
import os
import re
from typing import Iterable, Sequence

import numpy as np

from tf_twobranch.errors import ConfigError, DataFormatError

logger = logging.getLogger(__name__)

__all__ = ["WordVectors", "load_word_vectors", "save_word_vectors"]

_HEADER_RE = re.compile(rb"^\s*(\d+)\s+(\d+)\s*$")
_READ_CHUNK = 1 << 22


class WordVectors:
    """A fixed vocabulary of words with one float32 vector each.

    Args:
      words: the vocabulary, in row order; words must be unique.
      vectors: float32 array of shape (len(words), D).
    """

    def __init__(self, words: Sequence[str], vectors: np.ndarray):
        vectors = np.asarray(vectors, dtype=np.float32)
        words = list(words)
        if vectors.ndim != 2 or vectors.shape[0] != len(words):
            raise ConfigError(
                f"WordVectors needs a (len(words), D) matrix; got {len(words)} words "
                f"and an array of shape {vectors.shape}"
            )
        index = {}
        for row, word in enumerate(words):
            if word in index:
                raise ConfigError(f"WordVectors: word {word!r} appears twice (rows {index[word]} and {row})")
            index[word] = row
        self.words = words
        self.vectors = vectors
        self.index: dict[str, int] = index

    @property
    def dim(self) -> int:
        """Vector dimension D."""
        return int(self.vectors.shape[1])

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: object) -> bool:
        return word in self.index

    def __getitem__(self, word: str) -> np.ndarray:
        return self.vectors[self.index[word]]

    def lookup(self, tokens: Iterable[str]) -> np.ndarray:
        """Vectors of the known tokens, in order, as an (n, D) float32 array.

        Unknown tokens are dropped, so n may be smaller than len(tokens).
        """
        rows = [self.index[t] for t in tokens if t in self.index]
        return self.vectors[np.asarray(rows, dtype=np.int64)]

    def restrict(self, vocabulary: Iterable[str]) -> "WordVectors":
        """A copy holding only the words of `vocabulary` that are known."""
        keep = sorted({self.index[w] for w in vocabulary if w in self.index})
        return WordVectors([self.words[i] for i in keep], self.vectors[keep])


# --------------------------------------------------------------------------
# Reading


def _open_binary(path: str):
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _detect_format(path: str, head: bytes) -> tuple[str, int | None, int | None]:
    """Returns (format, V, D) where format is 'w2v_bin', 'w2v_text' or 'glove'."""
    if not head:
        raise DataFormatError(path, "the file is empty; expected word vectors in word2vec or GloVe format")
    newline = head.find(b"\n")
    first_line = head if newline < 0 else head[:newline]
    header = _HEADER_RE.match(first_line)
    if header:
        num_words, dim = int(header.group(1)), int(header.group(2))
        if dim <= 0:
            raise DataFormatError(path, f"the word2vec header announces dimension {dim}", line=1)
        if newline < 0:
            return "w2v_text", num_words, dim  # header only; no records follow
        rest = head[newline + 1 :]
        end = rest.find(b"\n")
        candidate = rest if end < 0 else rest[:end]
        if _is_text_vector_line(candidate, dim) or _looks_like_text(rest[: 4 * dim + 64]):
            # A text line with the wrong number of values is reported by the
            # text reader with its line number.
            return "w2v_text", num_words, dim
        return "w2v_bin", num_words, dim
    try:
        fields = first_line.decode("utf-8").rstrip("\r").split(" ")
    except UnicodeDecodeError:
        fields = []
    if len(fields) >= 2:
        try:
            [float(v) for v in fields[1:]]
            return "glove", None, len(fields) - 1
        except ValueError:
            pass
    raise DataFormatError(
        path,
        "unknown word-vector format: expected a word2vec header 'V D' (binary or text) "
        "or a GloVe line 'word v1 ... vD'",
        line=1,
    )


def _looks_like_text(block: bytes) -> bool:
    # Raw float32 bytes are essentially never valid, printable UTF-8.
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(block) - 4:
            return False
        text = block[: err.start].decode("utf-8")
    return all(c.isprintable() or c in "\n\r\t" for c in text)


def _is_text_vector_line(line: bytes, dim: int) -> bool:
    try:
        text = line.decode("utf-8").rstrip("\r").rstrip(" ")
    except UnicodeDecodeError:
        return False
    fields = text.rsplit(" ", dim)
    if len(fields) != dim + 1:
        return False
    try:
        [float(v) for v in fields[1:]]
    except ValueError:
        return False
    return True


def load_word_vectors(
    path: str | os.PathLike,
    *,
    max_words: int | None = None,
    vocabulary: Iterable[str] | None = None,
) -> WordVectors:
    """Reads word vectors in word2vec binary, word2vec text or GloVe text format.

    Args:
      path: a local file (optionally gzip-compressed); the format is detected
        from its content.
      max_words: only the first `max_words` records of the file are considered.
      vocabulary: when given, only these words are kept. The file is streamed,
        so restricting a 3M-word file to a caption vocabulary needs little memory.

    Raises:
      DataFormatError: unknown format, truncated file, a record whose
        dimension differs from the header/first line, a binary file whose
        records do not fit the header's dimension, or NaN/infinity in a kept
        vector (names the line or record).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataFormatError(path, "word-vector file not found (no vectors are downloaded; give a local path)")
    if max_words is not None and max_words <= 0:
        raise ConfigError(f"max_words must be positive, got {max_words}")
    wanted = None if vocabulary is None else set(vocabulary)
    with _open_binary(path) as stream:
        head = stream.read(1 << 16)
        # Editors on Windows start UTF-8 text with a byte-order mark; it belongs to no word.
        start = len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0
        head = head[start:]
        stream.seek(start)
        fmt, num_words, dim = _detect_format(path, head)
        if fmt == "w2v_bin":
            words, rows, places = _read_word2vec_binary(path, stream, num_words, dim, max_words, wanted)
        else:
            words, rows, places = _read_text(path, stream, fmt, num_words, dim, max_words, wanted)
    vectors = np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32)
    _check_finite(path, words, vectors, places)
    logger.info("Read %d word vectors of dimension %d from %s (%s)", len(words), dim, path, fmt)
    return WordVectors(words, vectors)


def _check_finite(path, words, vectors, places) -> None:
    """NaN or infinity in a kept vector is refused here, naming its line or record, rather
    than by the trainer's NaN guard, which cannot tell where it came from."""
    finite = np.isfinite(vectors).all(axis=1)
    if finite.all():
        return
    row = int(np.argmin(finite))
    bad = vectors[row][~np.isfinite(vectors[row])][0]
    kind, place = places[row]
    raise DataFormatError(path, f"the vector of word {words[row]!r} holds {bad} (expected finite "
                          "numbers)", **{kind: place})


def _read_word2vec_binary(path, stream, num_words, dim, max_words, wanted):
    stream.readline()  # the header "V D"
    record_bytes = 4 * dim
    limit = num_words if max_words is None else min(num_words, max_words)
    words: list[str] = []
    rows: list[np.ndarray] = []
    places: list[tuple[str, int]] = []
    seen: set[str] = set()
    buffer = b""
    pos = 0
    eof = False
    first_word = previous_word = None

    def fill(need: int):
        nonlocal buffer, pos, eof
        while len(buffer) - pos < need and not eof:
            chunk = stream.read(_READ_CHUNK)
            if not chunk:
                eof = True
                break
            buffer = buffer[pos:] + chunk
            pos = 0

    def skip_newlines():
        nonlocal pos
        while True:
            fill(1)
            if pos < len(buffer) and buffer[pos : pos + 1] in (b"\n", b"\r"):
                pos += 1
                continue
            return

    def dimension_error(record, detail: str) -> DataFormatError:
        guess = _guess_binary_dimension(path)
        if guess not in (None, dim) and first_word is not None:
            detail = f"its first word {first_word!r} is followed by {guess} float32 values, not {dim}"
            record = 0
        return DataFormatError(path, f"the header says dimension {dim}, but the record sizes "
                               f"disagree: {detail}", record=record)

    def truncated(record, message: str) -> DataFormatError:
        # A header whose dimension is wrong reads the records out of step until the file
        # ends early; that is not a truncated file.
        if _guess_binary_dimension(path) not in (None, dim):
            return dimension_error(record, f"the file ends inside record {record}")
        return DataFormatError(path, message, record=record)

    for record in range(limit):
        skip_newlines()
        while True:
            space = buffer.find(b" ", pos)
            if space >= 0 or eof:
                break
            fill(len(buffer) - pos + _READ_CHUNK)
        if space < 0:
            raise truncated(record, f"file is truncated: the header announces {num_words} words but "
                            f"the file ends at record {record} (0-based)")
        word_bytes = buffer[pos:space]
        if len(word_bytes) > 10000:
            raise DataFormatError(path, "no word separator found; the binary records are corrupt", record=record)
        if not _could_be_word(word_bytes):
            raise dimension_error(record, f"after the vector of word {previous_word!r}, record "
                                  f"{record} starts with bytes {word_bytes[:16]!r}, not a word")
        pos = space + 1
        fill(record_bytes)
        if len(buffer) - pos < record_bytes:
            raise truncated(record, f"file is truncated inside record {record}: expected "
                            f"{record_bytes} bytes ({dim} float32) after the word, found {len(buffer) - pos}")
        word = word_bytes.decode("utf-8", errors="replace")
        previous_word = word
        first_word = word if first_word is None else first_word
        if (wanted is None or word in wanted) and word not in seen:
            seen.add(word)
            words.append(word)
            rows.append(np.frombuffer(buffer, dtype="<f4", count=dim, offset=pos).copy())
            places.append(("record", record))
        pos += record_bytes
    if limit == num_words:
        skip_newlines()
        if pos < len(buffer):
            if _guess_binary_dimension(path) not in (None, dim):
                raise dimension_error(num_words, f"data follows the last of the {num_words} records")
            raise DataFormatError(path, f"data follows the last of the {num_words} records the header "
                                  f"announces (after the vector of word {previous_word!r}): the header's "
                                  "word count is too small", record=num_words)
    return words, rows, places


def _could_be_word(word_bytes: bytes) -> bool:
    """False for bytes that no word2vec vocabulary holds: float32 bytes read as a word.

    word2vec's C code cannot write a NUL inside a word; other control bytes are
    accepted in valid UTF-8, as some vocabularies hold them.
    """
    if b"\x00" in word_bytes:
        return False
    if any(b < 0x20 or b == 0x7F for b in word_bytes):
        try:
            word_bytes.decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def _guess_binary_dimension(path: str) -> int | None:
    """The dimension that the first two records of a binary file fit (each record ending in
    a newline, as word2vec writes them), or None when none does."""
    with _open_binary(path) as stream:
        data = stream.read(1 << 20)
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    data = data[data.find(b"\n") + 1 :]

    def next_record(start: int, candidate: int) -> int | None:
        """Where the record after the one starting at `start` starts, if it fits `candidate`."""
        space = data.find(b" ", start, start + 1000)
        if space <= start or not _could_be_word(data[start:space]):
            return None
        end = space + 1 + 4 * candidate
        if end == len(data) or data[end : end + 1] == b"\n":
            return end + 1
        return None

    first_space = data.find(b" ", 0, 1000)
    if first_space < 0:
        return None
    for candidate in range(1, (len(data) - first_space) // 4 + 1):
        second = next_record(0, candidate)
        if second is None:
            continue
        if second >= len(data) or next_record(second, candidate) is not None:
            return candidate
    return None


def _read_text(path, stream, fmt, num_words, dim, max_words, wanted):
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=None)
    words: list[str] = []
    rows: list[np.ndarray] = []
    places: list[tuple[str, int]] = []
    seen: set[str] = set()
    first_record_line = 1
    established = "the dimension of line 1"
    if fmt == "w2v_text":
        text.readline()
        first_record_line = 2
        established = "the header's dimension"
    count = 0
    for line_number, line in enumerate(text, start=first_record_line):
        if max_words is not None and count >= max_words:
            break
        line = line.rstrip("\n").rstrip("\r").rstrip(" ")
        if not line:
            continue
        count += 1
        # rsplit keeps words containing spaces (glove.840B has a few, e.g. ". . ." and
        # "at name@domain.com") intact; a word whose last piece is a number is instead a row
        # with more numbers than the dimension.
        fields = line.rsplit(" ", dim)
        word = fields[0]
        if len(fields) != dim + 1 or " " in word and (fmt == "w2v_text" or _is_number(word.rsplit(" ", 1)[1])):
            raise DataFormatError(
                path,
                f"expected a word followed by {dim} numbers ({established}), found "
                f"{_count_numbers(line)} numbers after {line.split(' ', 1)[0]!r}",
                line=line_number,
            )
        if wanted is not None and word not in wanted or word in seen:
            continue
        try:
            vector = np.asarray(fields[1:], dtype=np.float32)
        except ValueError:
            raise DataFormatError(path, f"non-numeric vector value for word {word!r}", line=line_number) from None
        seen.add(word)
        words.append(word)
        rows.append(vector)
        places.append(("line", line_number))
    if fmt == "w2v_text" and max_words is None and count != num_words:
        raise DataFormatError(
            path,
            f"the header announces {num_words} words but the file holds {count} records "
            "(truncated or wrong header)",
        )
    return words, rows, places


def _is_number(piece: str) -> bool:
    try:
        float(piece)
    except ValueError:
        return False
    return True


def _count_numbers(line: str) -> int:
    """How many space-separated pieces after the first one are numbers."""
    return sum(_is_number(piece) for piece in line.split(" ")[1:])


# --------------------------------------------------------------------------
# Writing


def save_word_vectors(path: str | os.PathLike, word_vectors: WordVectors, binary: bool = True) -> None:
    """Writes `word_vectors` in word2vec format (binary or text).

    The binary layout is that of GoogleNews-vectors-negative300.bin: header
    ``"V D\\n"``, then per word ``word<space><D float32 LE>\\n``.
    """
    path = os.fspath(path)
    for word in word_vectors.words:
        if not word or any(c in word for c in " \n\r\t"):
            raise ConfigError(f"cannot write word {word!r} in word2vec format (empty or contains whitespace)")
    vectors = np.asarray(word_vectors.vectors, dtype="<f4")
    with open(path, "wb") as out:
        out.write(f"{len(word_vectors)} {word_vectors.dim}\n".encode("ascii"))
        for word, vector in zip(word_vectors.words, vectors):
            if binary:
                out.write(word.encode("utf-8") + b" " + vector.tobytes() + b"\n")
            else:
                values = " ".join(repr(float(v)) for v in vector)
                out.write(f"{word} {values}\n".encode("utf-8"))
