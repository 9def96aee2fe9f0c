"""Dependency parses in CoNLL-U, the treebank format Stanford CoreNLP, Stanza,
UDPipe and spaCy write (https://universaldependencies.org/format.html).

One sentence is a block of comment lines and token lines, ended by a blank
line. Token lines have 10 tab-separated columns::

    ID  FORM  LEMMA  UPOS  XPOS  FEATS  HEAD  DEPREL  DEPS  MISC

``ID`` counts the words from 1, ``HEAD`` is the ID of the governor (0 for the
root), ``DEPREL`` the relation to it. Multiword-token lines (``1-2``) and
empty nodes (``1.1``) are not part of the basic tree and are skipped. A
sentence is keyed by its ``# sent_id = <id>`` comment; the package's caption
ids are ``<image id>#<k>`` (the Flickr8K/Flickr30K token-file key, image
extension stripped as everywhere else), and ``# text = ...`` is kept.

A caption that the parser split into two sentences has two roots (18 of the
40,460 spaCy parses of Flickr8K do): allowed. Every word must reach a root
(no cycle). Errors name the file, the line and the sentence id.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Mapping

from tf_twobranch.data.formats._common import read_text, strip_image_extension
from tf_twobranch.errors import DataFormatError

__all__ = ["DependencyTree", "read_conllu", "write_conllu", "caption_key"]

NUM_COLUMNS = 10


@dataclasses.dataclass(frozen=True)
class DependencyTree:
    """One parsed sentence: word i (0-based) hangs from ``heads[i]`` (1-based, 0 = root)."""

    sent_id: str
    words: tuple[str, ...]
    heads: tuple[int, ...]
    relations: tuple[str, ...]
    lemmas: tuple[str, ...] = ()
    text: str | None = None

    def __len__(self) -> int:
        return len(self.words)


def caption_key(sent_id: str) -> str:
    """``1000268201_693b08cb0e.jpg#0`` -> ``1000268201_693b08cb0e#0`` (the caption-id convention)."""
    image, sep, number = sent_id.rpartition("#")
    return f"{strip_image_extension(image)}#{number}" if sep else sent_id


def _check_tree(path, tree: DependencyTree, lines: list[int]) -> None:
    n = len(tree.words)
    line = lines[0]
    for i, head in enumerate(tree.heads):
        if not 0 <= head <= n:
            raise DataFormatError(path, f"word {i + 1} ({tree.words[i]!r}) has head {head}, outside "
                                  f"0..{n} (the sentence has {n} words)", line=lines[i],
                                  record=tree.sent_id)
    if n and 0 not in tree.heads:
        raise DataFormatError(path, "no word has head 0: the sentence has no root",
                              line=line, record=tree.sent_id)
    # Follow heads from each word; a walk longer than n steps is a cycle.
    for start in range(1, n + 1):
        node, steps = start, 0
        while node != 0:
            node = tree.heads[node - 1]
            steps += 1
            if steps > n:
                raise DataFormatError(path, f"the heads form a cycle through word {start} "
                                      f"({tree.words[start - 1]!r}); every word must reach the root",
                                      line=lines[start - 1], record=tree.sent_id)


def read_conllu(path: str | os.PathLike, *, key=caption_key) -> dict[str, DependencyTree]:
    """Sentences of a CoNLL-U file by key (default `caption_key` of ``sent_id``), in file order.

    Raises:
      DataFormatError naming the file, line and sentence: a token line
      without 10 tab-separated columns, a non-integer ID or HEAD, IDs not
      1, 2, 3, ..., a head out of range, a cycle, no root, a sentence
      without ``# sent_id``, a repeated id, or a file with no sentence.
    """
    path = os.fspath(path)
    trees: dict[str, DependencyTree] = {}
    first_line: dict[str, int] = {}
    comments: dict[str, str] = {}
    rows: list[tuple[int, list[str]]] = []
    start_line = 1

    def finish(end_line: int) -> None:
        nonlocal rows, comments
        if not rows:
            comments = {}
            return
        sent_id = comments.get("sent_id")
        if not sent_id:
            raise DataFormatError(path, "sentence without a '# sent_id = ...' comment",
                                  line=start_line)
        words, heads, relations, lemmas = [], [], [], []
        for line_number, cols in rows:
            try:
                word_id, head = int(cols[0]), int(cols[6])
            except ValueError:
                raise DataFormatError(path, f"ID and HEAD must be integers, got {cols[0]!r} and "
                                      f"{cols[6]!r}", line=line_number, record=sent_id) from None
            if word_id != len(words) + 1:
                raise DataFormatError(path, f"word ID {word_id} out of order (expected "
                                      f"{len(words) + 1})", line=line_number, record=sent_id)
            words.append(cols[1])
            lemmas.append(cols[2])
            heads.append(head)
            relations.append(cols[7])
        tree = DependencyTree(sent_id, tuple(words), tuple(heads), tuple(relations), tuple(lemmas),
                              comments.get("text"))
        _check_tree(path, tree, [line_number for line_number, _ in rows])
        k = key(sent_id)
        if k in trees:
            raise DataFormatError(path, f"sentence id {sent_id!r} repeated (first at line "
                                  f"{first_line[k]})", line=start_line, record=sent_id)
        trees[k] = tree
        first_line[k] = start_line
        rows, comments = [], {}

    lines = read_text(path).splitlines()
    for line_number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            finish(line_number)
            start_line = line_number + 1
            continue
        if line.startswith("#"):
            name, sep, value = line[1:].partition("=")
            if sep:
                comments[name.strip()] = value.strip()
            continue
        cols = line.split("\t")
        if len(cols) != NUM_COLUMNS:
            raise DataFormatError(path, f"expected {NUM_COLUMNS} tab-separated columns (ID FORM LEMMA "
                                  f"UPOS XPOS FEATS HEAD DEPREL DEPS MISC), got {len(cols)}",
                                  line=line_number, record=comments.get("sent_id"))
        if "-" in cols[0] or "." in cols[0]:
            continue  # multiword token or empty node: not in the basic tree
        rows.append((line_number, cols))
    finish(len(lines) + 1)
    if not trees:
        raise DataFormatError(path, "no sentence found; expected CoNLL-U token lines")
    return trees


def write_conllu(path: str | os.PathLike, trees: Iterable[DependencyTree] | Mapping[str, DependencyTree]) -> None:
    """Writes sentences as CoNLL-U (ID FORM LEMMA _ _ _ HEAD DEPREL _ _), one block each."""
    if isinstance(trees, Mapping):
        trees = trees.values()
    with open(path, "w", encoding="utf-8") as f:
        for tree in trees:
            f.write(f"# sent_id = {tree.sent_id}\n")
            if tree.text is not None:
                f.write(f"# text = {tree.text}\n")
            lemmas = tree.lemmas or tree.words
            for i, (word, head, rel) in enumerate(zip(tree.words, tree.heads, tree.relations), start=1):
                f.write(f"{i}\t{word}\t{lemmas[i - 1]}\t_\t_\t_\t{head}\t{rel}\t_\t_\n")
            f.write("\n")
