"""Sentence fragments of Karpathy, Joulin & Fei-Fei (NIPS 2014, §3.1): typed
dependency triplets (R, w1, w2), or the paper's BOW / bigram ablations.

* ``dependency``: every edge of the parse, ``(relation, governor, dependent)``
  (CoreNLP's ``rel(gov, dep)`` order), ROOT edges dropped. With
  `collapse_prepositions` the pair ``prep(g, p)`` + ``pobj(p, o)`` becomes
  ``prep_<p>(g, o)`` as in CoreNLP's collapsed dependencies, which the paper
  used (e.g. ``prep_in``); spaCy/ClearNLP output keeps them apart.
* ``bow``: one fragment per word, w1 = w2 (relation ``bow``).
* ``bigram``: consecutive words (relation ``bigram``).

Then the paper's filtering (§4): relation types that make up less than 1 %
of the training fragments are dropped (`frequent_relations`), and so are
fragments with a word that has no word vector. Words are lower-cased.
`caption_trees` joins a CoNLL-U file to a caption corpus by caption id.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Iterable, Mapping, Sequence

import numpy as np

from tf_twobranch.data.corpus import CaptionCorpus, caption_keys
from tf_twobranch.data.formats.conllu import DependencyTree
from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = ["FRAGMENT_KINDS", "Triplet", "tree_triplets", "caption_keys", "caption_trees",
           "relation_counts", "frequent_relations", "EncodedFragments", "encode_fragments"]

FRAGMENT_KINDS = ("dependency", "bow", "bigram")
ROOT_RELATIONS = frozenset({"root", "ROOT"})


@dataclasses.dataclass(frozen=True)
class Triplet:
    """A sentence fragment; ``index1`` / ``index2``: the 0-based positions of `word1` and `word2`
    in the parsed sentence (the governor and the dependent; -1 when unknown; not compared)."""
    relation: str
    word1: str
    word2: str
    index1: int = dataclasses.field(default=-1, compare=False)
    index2: int = dataclasses.field(default=-1, compare=False)


def tree_triplets(tree: DependencyTree, kind: str = "dependency", *,
                  collapse_prepositions: bool = False) -> list[Triplet]:
    """The fragments of one parsed sentence (see the module docstring), in word order."""
    if kind not in FRAGMENT_KINDS:
        raise ConfigError(f"fragments must be one of {FRAGMENT_KINDS}, got {kind!r}")
    words = [w.lower() for w in tree.words]
    if kind == "bow":
        return [Triplet("bow", w, w, i, i) for i, w in enumerate(words)]
    if kind == "bigram":
        return [Triplet("bigram", a, b, i, i + 1) for i, (a, b) in enumerate(zip(words, words[1:]))]
    folded: set[int] = set()          # pobj edges folded into prep_<word>
    replacement: dict[int, Triplet] = {}
    if collapse_prepositions:
        for i, (head, rel) in enumerate(zip(tree.heads, tree.relations)):
            if rel != "pobj" or head == 0 or tree.relations[head - 1] != "prep":
                continue
            prep = head - 1
            governor = tree.heads[prep]
            if governor == 0 or prep in replacement:
                continue      # a root preposition, or its first object already taken
            replacement[prep] = Triplet(f"prep_{words[prep]}", words[governor - 1], words[i], governor - 1, i)
            folded.add(i)
    out = []
    for i, (head, rel) in enumerate(zip(tree.heads, tree.relations)):
        if head == 0 or rel in ROOT_RELATIONS or i in folded:
            continue
        out.append(replacement.get(i, Triplet(rel, words[head - 1], words[i], head - 1, i)))
    return out


def _collapsed(text: str) -> str:
    return " ".join(text.split())


def _by_image(trees: Mapping[str, DependencyTree]) -> dict[str, list[tuple[str, DependencyTree]]]:
    grouped: dict[str, list[tuple[int, str, DependencyTree]]] = collections.defaultdict(list)
    for key, tree in trees.items():
        image, sep, number = key.rpartition("#")
        order = int(number) if sep and number.isdigit() else len(grouped[key])
        grouped[image if sep else key].append((order, key, tree))
    return {image: [(key, tree) for _, key, tree in sorted(items, key=lambda x: x[0])]
            for image, items in grouped.items()}


def caption_trees(trees: Mapping[str, DependencyTree], corpus: CaptionCorpus,
                  source: str | os.PathLike = "the CoNLL-U file", *,
                  check_text: bool = True) -> list[DependencyTree]:
    """The parse of every caption of `corpus`, in caption order.

    Parses are keyed ``<image id>#<k>`` (`read_conllu`); an image's p-th
    caption gets the parse with its p-th smallest k (token files number
    captions 0-4, but the real Flickr8K file has an image whose numbers
    start at 1). Raises DataFormatError naming `source` and the caption when
    an image has fewer parses than captions, or (with `check_text`) when a
    parse's ``# text`` is not its caption (whitespace collapsed): parses of
    another caption file. Parses of images outside the corpus (other splits)
    are ignored.
    """
    by_image = _by_image(trees)
    out = []
    for key, caption, image in zip(caption_keys(corpus), corpus.captions, corpus.caption_image):
        position = int(key.rpartition("#")[2])
        parses = by_image.get(corpus.image_ids[image], [])
        if position >= len(parses):
            raise DataFormatError(source, f"no parse of caption {key!r} of "
                                  f"{corpus.source or 'the caption file'} ({caption[:60]!r}); the "
                                  f"file has {len(parses)} parses of image {corpus.image_ids[image]!r}",
                                  record=key)
        parse_key, tree = parses[position]
        if check_text and tree.text is not None and _collapsed(tree.text) != _collapsed(caption):
            raise DataFormatError(source, f"the parse {parse_key!r} is of {tree.text[:60]!r}, but "
                                  f"the caption file has {caption[:60]!r}", record=parse_key)
        out.append(tree)
    return out


def relation_counts(fragments: Iterable[Sequence[Triplet]]) -> collections.Counter:
    """How many fragments of each relation type."""
    return collections.Counter(t.relation for sentence in fragments for t in sentence)


def frequent_relations(counts: Mapping[str, int], min_fraction: float = 0.01) -> list[str]:
    """Relation types making up at least `min_fraction` of all fragments, most frequent first."""
    total = sum(counts.values())
    if total == 0:
        return []
    kept = [r for r, c in counts.items() if c >= min_fraction * total]
    return sorted(kept, key=lambda r: (-counts[r], r))


@dataclasses.dataclass
class EncodedFragments:
    """The fragments of a list of sentences as id arrays (ragged by `row_splits`).

    ``relation``, ``word1``, ``word2``: int32 (total,); sentence s owns rows
    ``row_splits[s]:row_splits[s + 1]``. ``empty``: sentences left with no
    fragment after filtering. ``positions``: int32 (total, 2), where the two
    words stand in the parsed sentence (`Triplet.index1`, `Triplet.index2`; -1
    unknown). ``words``: each sentence's parsed words, lower-cased, when kept
    (the evaluated splits: grounding maps Entities phrases onto them); else None.
    """

    relation: np.ndarray
    word1: np.ndarray
    word2: np.ndarray
    row_splits: np.ndarray
    positions: np.ndarray | None = None
    words: list[tuple[str, ...]] | None = None

    @property
    def num_sentences(self) -> int:
        return len(self.row_splits) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.row_splits)

    @property
    def empty(self) -> np.ndarray:
        return np.flatnonzero(self.lengths == 0)


def encode_fragments(fragments: Sequence[Sequence[Triplet]], relations: Sequence[str],
                     word_index: Mapping[str, int], *,
                     words: Sequence[Sequence[str]] | None = None) -> EncodedFragments:
    """Ids of the fragments whose relation is in `relations` and whose two words
    are in `word_index` (the word-vector vocabulary); the others are dropped.
    `words`: the sentences' parsed words, kept in the result (`EncodedFragments.words`)."""
    relation_index = {r: i for i, r in enumerate(relations)}
    rel, w1, w2, positions, splits = [], [], [], [], [0]
    for sentence in fragments:
        for t in sentence:
            r = relation_index.get(t.relation)
            a, b = word_index.get(t.word1), word_index.get(t.word2)
            if r is None or a is None or b is None:
                continue
            rel.append(r)
            w1.append(a)
            w2.append(b)
            positions.append((t.index1, t.index2))
        splits.append(len(rel))
    as_ids = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return EncodedFragments(as_ids(rel), as_ids(w1), as_ids(w2), np.asarray(splits, np.int64),
                            np.asarray(positions, np.int32).reshape(-1, 2),
                            None if words is None else [tuple(w.lower() for w in s) for s in words])
