"""Dependency parses of the embedded dataset's captions, written as CoNLL-U.

The captions come from the closed grammar of `tf_twobranch.data.scene_grammar`,
so their structure is known: the annotated phrases (Flickr30K Entities
``Sentences/`` files) are the noun phrases, and the words between them are
one of the grammar's templates. This module rebuilds each caption's tree
from those two pieces with the labels spaCy's English models write (ClearNLP
style: ``det``, ``amod``, ``compound``, ``nummod``, ``prep``, ``pobj``,
``nsubj``, ``dobj``, ``attr``, ``expl``, ``acl``, ``conj``, ``cc``,
``appos``, ``punct``, ``root``), so that the fragment experiment reads the
embedded data through the same CoNLL-U reader as a user's parser output.

`write_embedded_parses(dataset_dir)` writes ``captions.conllu`` next to the
token file (``# sent_id = <image>.jpg#<k>``, ``# text = <caption>``); the
generator calls it, and `embedded_parses_path` adds it to a folder generated
before it existed. A caption outside the grammar is an error naming it.
"""
from __future__ import annotations

import os
import pathlib

from tf_twobranch.data.formats import read_token_file
from tf_twobranch.data.formats.conllu import DependencyTree, write_conllu
from tf_twobranch.data.formats.flickr30k_entities import read_sentence_file
from tf_twobranch.data.formats.row_arrays import temp_beside
from tf_twobranch.errors import DataFormatError

__all__ = ["PARSES_NAME", "parse_caption", "write_embedded_parses", "embedded_parses_path"]

PARSES_NAME = "captions.conllu"
TOKEN_FILE = "results_20130124.token"

_DETERMINERS = {"a", "an", "the", "this"}
_NUMBERS = {"one", "two", "three", "four", "five", "six"}
_NOUN_PREFIXES = {"digit", "number"}


class _Tree:
    """Arcs over the caption's word positions (0-based), filled as units are parsed."""

    def __init__(self, words):
        self.words = words
        self.heads = [None] * len(words)
        self.relations = [None] * len(words)

    def arc(self, head: int, dependent: int, relation: str) -> None:
        self.heads[dependent] = head
        self.relations[dependent] = relation


class _Unparsed(ValueError):
    pass


def _noun_phrase(tree: _Tree, start: int, stop: int) -> int:
    """Arcs inside a grammar noun phrase words[start:stop]; returns its head position."""
    words = [w.lower() for w in tree.words]
    if stop - start >= 4 and words[start:start + 3] == ["a", "pair", "of"]:
        tree.arc(start + 1, start, "det")
        tree.arc(start + 1, start + 2, "prep")
        tree.arc(start + 2, _noun_phrase(tree, start + 3, stop), "pobj")
        return start + 1
    core_stop = stop
    for i in range(start + 1, stop):
        if words[i] == "in":          # "a seven in red", "a five in bright blue"
            core_stop = i
            break
    head = core_stop - 1
    for i in range(start, head):
        if words[i] in _DETERMINERS:
            relation = "det"
        elif words[i] in _NUMBERS and i == start:
            relation = "nummod"
        elif words[i] in _NOUN_PREFIXES and i == head - 1:
            relation = "compound"
        else:
            relation = "amod"
        tree.arc(head, i, relation)
    if core_stop < stop:
        colour = stop - 1
        tree.arc(head, core_stop, "prep")
        tree.arc(core_stop, colour, "pobj")
        for i in range(core_stop + 1, colour):
            tree.arc(colour, i, "amod")
    return head


class _Parser:
    """Recursive descent over units: a phrase (its head) or one glue word."""

    def __init__(self, words, phrases):
        self.tree = _Tree(words)
        self.lower = [w.lower() for w in words]
        self.phrase_at = {}
        for first, length in phrases:
            self.phrase_at[first] = (first, first + length)
        self.i = 0

    # -- tokens
    def peek(self, offset: int = 0) -> str | None:
        j = self.i + offset
        return self.lower[j] if j < len(self.lower) else None

    def at_phrase(self) -> bool:
        return self.i in self.phrase_at

    def word(self, *expected: str) -> int:
        if self.peek() not in expected:
            raise _Unparsed(f"expected {' / '.join(expected)!r} at word {self.i + 1}, found {self.peek()!r}")
        self.i += 1
        return self.i - 1

    def phrase(self) -> int:
        if not self.at_phrase():
            raise _Unparsed(f"expected an annotated phrase at word {self.i + 1}, found {self.peek()!r}")
        first, stop = self.phrase_at[self.i]
        self.i = stop
        return _noun_phrase(self.tree, first, stop)

    def entity_list(self) -> int:
        """P (, P)* (and P)?: the first conjunct heads the others."""
        first = self.phrase()
        while self.peek() in (",", "and") and (self.i + 1) in self.phrase_at:
            glue = self.i
            self.i += 1
            self.tree.arc(first, glue, "punct" if self.lower[glue] == "," else "cc")
            self.tree.arc(first, self.phrase(), "conj")
        return first

    def on_scene(self, head: int) -> None:
        on = self.word("on")
        self.tree.arc(head, on, "prep")
        self.tree.arc(on, self.phrase(), "pobj")

    def copula(self) -> int:
        return self.word("is", "are")

    def location(self, head: int) -> int:
        """in the middle / on the left side / at the top / in the top left corner: returns its noun."""
        preposition = self.word("in", "on", "at")
        self.tree.arc(head, preposition, "prep")
        the = self.word("the")
        start = self.i
        while self.peek() in ("top", "middle", "bottom", "left", "centre", "right", "side", "corner"):
            self.i += 1
        if self.i == start:
            raise _Unparsed(f"expected a location after {self.lower[preposition]!r} at word {self.i + 1}")
        noun = self.i - 1
        self.tree.arc(preposition, noun, "pobj")
        self.tree.arc(noun, the, "det")
        for j in range(start, noun):
            self.tree.arc(noun, j, "amod")
        return noun

    def relation(self, verb: int) -> None:
        """to the left/right of P | next to P | beside/near/above/over/below/under P."""
        if self.peek() == "to" and self.peek(1) == "the":
            to = self.word("to")
            the = self.word("the")
            side = self.word("left", "right")
            of = self.word("of")
            self.tree.arc(verb, to, "prep")
            self.tree.arc(to, side, "pobj")
            self.tree.arc(side, the, "det")
            self.tree.arc(side, of, "prep")
            self.tree.arc(of, self.phrase(), "pobj")
        elif self.peek() == "next":
            nxt = self.word("next")
            to = self.word("to")
            self.tree.arc(verb, nxt, "advmod")
            self.tree.arc(nxt, to, "prep")
            self.tree.arc(to, self.phrase(), "pobj")
        else:
            preposition = self.word("beside", "near", "above", "over", "below", "under")
            self.tree.arc(verb, preposition, "prep")
            self.tree.arc(preposition, self.phrase(), "pobj")

    # -- templates
    def sentence(self) -> int:
        w = self.peek()
        if w in ("a", "an") and not self.at_phrase():           # a picture showing / an image of ...
            det = self.word("a", "an")
            noun = self.word("picture", "image", "photo")
            self.tree.arc(noun, det, "det")
            if self.peek() == "showing":
                showing = self.word("showing")
                self.tree.arc(noun, showing, "acl")
                self.tree.arc(showing, self.entity_list(), "dobj")
            else:
                preposition = self.word("of", "with")
                self.tree.arc(noun, preposition, "prep")
                self.tree.arc(preposition, self.entity_list(), "pobj")
            return noun
        if w == "there":
            there = self.word("there")
            verb = self.copula()
            self.tree.arc(verb, there, "expl")
            self.tree.arc(verb, self.entity_list(), "attr")
            self.on_scene(verb)
            return verb
        if w in _NUMBERS and not self.at_phrase():               # three digits : ...
            number = self.word(*_NUMBERS)
            modifiers = []
            while self.peek() == "handwritten":
                modifiers.append(self.word("handwritten"))
            noun = self.word("digit", "digits", "number", "numbers")
            self.tree.arc(noun, number, "nummod")
            for m in modifiers:
                self.tree.arc(noun, m, "amod")
            self.tree.arc(noun, self.word(":"), "punct")
            self.tree.arc(noun, self.entity_list(), "appos")
            return noun
        first = self.entity_list()
        nxt = self.peek()
        if nxt in ("shows", "contains", "wrote", "drew"):          # this picture shows / someone wrote
            verb = self.word(nxt)
            self.tree.arc(verb, first, "nsubj")
            self.tree.arc(verb, self.entity_list(), "dobj")
            if self.peek() == "on":
                self.on_scene(verb)
            return verb
        if nxt in ("is", "are"):
            verb = self.copula()
            self.tree.arc(verb, first, "nsubj")
            if self.peek() in ("in", "on", "at") and self.peek(1) == "the":
                self.location(verb)
            else:
                self.relation(verb)
            if self.peek() == ",":                                   # , and there is also L
                self.tree.arc(verb, self.word(","), "punct")
                self.tree.arc(verb, self.word("and"), "cc")
                there = self.word("there")
                second = self.copula()
                also = self.word("also")
                self.tree.arc(verb, second, "conj")
                self.tree.arc(second, there, "expl")
                self.tree.arc(second, also, "advmod")
                self.tree.arc(second, self.entity_list(), "attr")
            return verb
        if nxt == ",":                                               # L , drawn on S
            self.tree.arc(first, self.word(","), "punct")
            verb = self.word("drawn", "written", "painted")
            self.tree.arc(first, verb, "acl")
            self.on_scene(verb)
            return first
        if nxt in ("in", "on", "at") and self.peek(1) == "the":        # L in the top left corner of S
            noun = self.location(first)
            of = self.word("of")
            self.tree.arc(noun, of, "prep")
            self.tree.arc(of, self.phrase(), "pobj")
            return first
        if nxt == "on":                                               # L on S
            self.on_scene(first)
        return first

    def parse(self) -> _Tree:
        root = self.sentence()
        if self.peek() == ".":
            self.tree.arc(root, self.word("."), "punct")
        if self.i != len(self.lower):
            raise _Unparsed(f"words left over from word {self.i + 1}: {' '.join(self.lower[self.i:])!r}")
        self.tree.heads[root] = None
        self.tree.relations[root] = "root"
        return self.tree


def parse_caption(words, phrases, sent_id: str = "caption") -> DependencyTree:
    """The tree of one grammar caption: `words` and its phrases as (first word, length) pairs."""
    words = list(words)
    try:
        tree = _Parser(words, phrases).parse()
    except _Unparsed as err:
        raise DataFormatError(sent_id, f"not a caption of the embedded grammar ({err}): "
                              f"{' '.join(words)!r}") from None
    missing = [i for i, r in enumerate(tree.relations) if r is None]
    if missing:
        raise DataFormatError(sent_id, f"word {missing[0] + 1} ({words[missing[0]]!r}) got no head: "
                              f"{' '.join(words)!r}")
    heads = tuple(0 if h is None else h + 1 for h in tree.heads)
    return DependencyTree(sent_id, tuple(words), heads, tuple(tree.relations), text=" ".join(words))


def write_embedded_parses(dataset_dir: str | os.PathLike, captions=None) -> pathlib.Path:
    """Writes ``captions.conllu`` (see the module docstring).

    `captions`: (sent_id, words, [(first word, length) of each phrase]) of
    every caption, as the generator has them; default: read from the token
    file and the ``Sentences/`` files.
    """
    root = pathlib.Path(dataset_dir)
    if captions is None:
        captions = []
        for image_id in read_token_file(root / TOKEN_FILE).image_ids:
            for k, sentence in enumerate(read_sentence_file(root / "Sentences" / f"{image_id}.txt")):
                captions.append((f"{image_id}.jpg#{k}", sentence.words,
                                 [(p.first_word_index, len(p.text.split())) for p in sentence.phrases]))
    trees = [parse_caption(words, phrases, sent_id) for sent_id, words, phrases in captions]
    path = root / PARSES_NAME
    tmp = temp_beside(path)
    write_conllu(tmp, trees)
    tmp.replace(path)
    return path


def embedded_parses_path(dataset_dir: str | os.PathLike) -> pathlib.Path:
    """``<dataset_dir>/captions.conllu``, written first if the folder predates it."""
    path = pathlib.Path(dataset_dir) / PARSES_NAME
    return path if path.exists() else write_embedded_parses(dataset_dir)
