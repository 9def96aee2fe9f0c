"""The embedded dataset's CoNLL-U parses: every generated caption parses, the reader reads them back."""
import collections

import pytest

from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.data.embedded_parses import PARSES_NAME, embedded_parses_path, parse_caption
from tf_twobranch.data.formats import read_token_file
from tf_twobranch.data.formats.conllu import read_conllu
from tf_twobranch.systems.fragments.sentence_fragments import (caption_trees, frequent_relations, relation_counts,
                                                  tree_triplets)
from tf_twobranch.errors import DataFormatError


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=60,
                                     splits=(40, 10, 10), with_proposals=False)


def test_generator_writes_a_parse_of_every_caption(dataset):
    corpus = read_token_file(dataset / "results_20130124.token")
    trees = caption_trees(read_conllu(dataset / PARSES_NAME), corpus, dataset / PARSES_NAME)
    assert len(trees) == corpus.num_captions
    counts = relation_counts(tree_triplets(t) for t in trees)
    assert {"det", "amod", "prep", "pobj"} <= set(frequent_relations(counts))
    # The same file is rebuilt from the Sentences/ markup for folders generated before it existed.
    (dataset / PARSES_NAME).rename(dataset / "kept.conllu")
    assert read_conllu(embedded_parses_path(dataset)) == read_conllu(dataset / "kept.conllu")


def test_grammar_structures():
    words = "A red seven is to the left of the blue 5 , and there is also a big two in green .".split()
    tree = parse_caption(words, [(0, 3), (8, 3), (16, 5)])
    arcs = {(w, words[h - 1] if h else None, r) for w, h, r in zip(words, tree.heads, tree.relations)}
    assert {("seven", "is", "nsubj"), ("is", None, "root"), ("of", "left", "prep"),
            ("5", "of", "pobj"), ("two", "is", "attr"), ("green", "in", "pobj")} <= arcs
    assert collections.Counter(tree.relations)["root"] == 1


def test_a_caption_outside_the_grammar_is_named():
    with pytest.raises(DataFormatError, match="img.jpg#0.*not a caption of the embedded grammar"):
        parse_caption("A seven juggles a five .".split(), [(0, 2), (3, 2)], "img.jpg#0")
