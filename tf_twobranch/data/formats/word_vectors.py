"""Word-vector files: reading and writing word2vec/GloVe files.

Supported on-disk layouts (detected from the file content, not the name):

* word2vec binary (the layout of ``GoogleNews-vectors-negative300.bin``):
  an ASCII header ``"V D\\n"``, then for every word: the word's UTF-8 bytes, a
  space, ``D`` little-endian float32 values, and an optional newline.
* word2vec text: the same header line, then one line ``word v1 ... vD`` per word.
* GloVe text: no header, one line ``word v1 ... vD`` per word.

Any of these may be gzip-compressed (detected from the magic bytes).

No vectors are ever downloaded: pass a local path, or train count-based
vectors on your own captions with `tf_twobranch.features.word_vectors.train_word_vectors`.
"""
from __future__ import annotations

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
      DataFormatError: unknown format, truncated file, or a record whose
        dimension differs from the header/first line (names the line or record).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataFormatError(path, "word-vector file not found (no vectors are downloaded; give a local path)")
    if max_words is not None and max_words <= 0:
        raise ConfigError(f"max_words must be positive, got {max_words}")
    wanted = None if vocabulary is None else set(vocabulary)
    with _open_binary(path) as stream:
        head = stream.read(1 << 16)
        stream.seek(0)
        fmt, num_words, dim = _detect_format(path, head)
        if fmt == "w2v_bin":
            words, rows = _read_word2vec_binary(path, stream, num_words, dim, max_words, wanted)
        else:
            words, rows = _read_text(path, stream, fmt, num_words, dim, max_words, wanted)
    vectors = np.stack(rows).astype(np.float32) if rows else np.zeros((0, dim), np.float32)
    logger.info("Read %d word vectors of dimension %d from %s (%s)", len(words), dim, path, fmt)
    return WordVectors(words, vectors)


def _read_word2vec_binary(path, stream, num_words, dim, max_words, wanted):
    # Skip the header line.
    header = stream.readline()
    del header
    record_bytes = 4 * dim
    limit = num_words if max_words is None else min(num_words, max_words)
    words: list[str] = []
    rows: list[np.ndarray] = []
    seen: set[str] = set()
    buffer = b""
    pos = 0
    eof = False

    def fill(need: int):
        nonlocal buffer, pos, eof
        while len(buffer) - pos < need and not eof:
            chunk = stream.read(_READ_CHUNK)
            if not chunk:
                eof = True
                break
            buffer = buffer[pos:] + chunk
            pos = 0

    for record in range(limit):
        # Word: skip separating newlines, then read up to the space.
        while True:
            fill(1)
            if pos < len(buffer) and buffer[pos : pos + 1] in (b"\n", b"\r"):
                pos += 1
                continue
            break
        while True:
            space = buffer.find(b" ", pos)
            if space >= 0 or eof:
                break
            fill(len(buffer) - pos + _READ_CHUNK)
        if space < 0:
            raise DataFormatError(
                path,
                f"file is truncated: the header announces {num_words} words but the "
                f"file ends at record {record} (0-based)",
                record=record,
            )
        word_bytes = buffer[pos:space]
        if len(word_bytes) > 10000:
            raise DataFormatError(path, "no word separator found; the binary records are corrupt", record=record)
        pos = space + 1
        fill(record_bytes)
        if len(buffer) - pos < record_bytes:
            raise DataFormatError(
                path,
                f"file is truncated inside record {record}: expected {record_bytes} bytes "
                f"({dim} float32) after the word, found {len(buffer) - pos}",
                record=record,
            )
        word = word_bytes.decode("utf-8", errors="replace")
        if (wanted is None or word in wanted) and word not in seen:
            seen.add(word)
            words.append(word)
            rows.append(np.frombuffer(buffer, dtype="<f4", count=dim, offset=pos).copy())
        pos += record_bytes
    return words, rows


def _read_text(path, stream, fmt, num_words, dim, max_words, wanted):
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=None)
    words: list[str] = []
    rows: list[np.ndarray] = []
    seen: set[str] = set()
    first_record_line = 1
    if fmt == "w2v_text":
        text.readline()
        first_record_line = 2
    count = 0
    for line_number, line in enumerate(text, start=first_record_line):
        if max_words is not None and count >= max_words:
            break
        line = line.rstrip("\n").rstrip("\r").rstrip(" ")
        if not line:
            continue
        count += 1
        # rsplit keeps words containing spaces (some GloVe files have them) intact.
        fields = line.rsplit(" ", dim)
        if len(fields) != dim + 1 or " " in fields[0] and fmt == "w2v_text":
            raise DataFormatError(
                path,
                f"expected a word followed by {dim} numbers, found {len(line.split(' ')) - 1} numbers",
                line=line_number,
            )
        word = fields[0]
        if wanted is not None and word not in wanted or word in seen:
            continue
        try:
            vector = np.asarray(fields[1:], dtype=np.float32)
        except ValueError:
            raise DataFormatError(path, f"non-numeric vector value for word {word!r}", line=line_number) from None
        seen.add(word)
        words.append(word)
        rows.append(vector)
    if fmt == "w2v_text" and max_words is None and count != num_words:
        raise DataFormatError(
            path,
            f"the header announces {num_words} words but the file holds {count} records "
            "(truncated or wrong header)",
        )
    return words, rows


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
