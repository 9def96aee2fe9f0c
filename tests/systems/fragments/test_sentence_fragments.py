"""Sentence fragments (Karpathy et al. 2014 §3.1): triplets, the 1 % filter, the caption join, real parses."""
import pathlib

import numpy as np
import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.conllu import DependencyTree, read_conllu
from tf_twobranch.systems.fragments.sentence_fragments import (Triplet, caption_trees, encode_fragments,
                                                  frequent_relations, relation_counts, tree_triplets)
from tf_twobranch.errors import ConfigError, DataFormatError

REAL = pathlib.Path(__file__).resolve().parents[4] / "shared" / "realdata" / "flickr8k"

# "A girl going into a wooden building ."
TREE = DependencyTree("img.jpg#0", ("A", "girl", "going", "into", "a", "wooden", "building", "."),
                      (2, 0, 2, 3, 7, 7, 4, 2),
                      ("det", "root", "acl", "prep", "det", "amod", "pobj", "punct"),
                      text="A girl going into a wooden building .")


def test_dependency_triplets_are_governor_then_dependent_without_root():
    triplets = tree_triplets(TREE)
    assert Triplet("det", "girl", "a") in triplets and Triplet("pobj", "into", "building") in triplets
    assert all(t.relation != "root" for t in triplets) and len(triplets) == 7


def test_collapsing_prepositions_as_corenlp():
    triplets = tree_triplets(TREE, collapse_prepositions=True)
    assert Triplet("prep_into", "going", "building") in triplets
    assert not any(t.relation in ("prep", "pobj") for t in triplets) and len(triplets) == 6


def test_bow_and_bigram_ablations():
    assert tree_triplets(TREE, "bow")[1] == Triplet("bow", "girl", "girl")
    bigrams = tree_triplets(TREE, "bigram")
    assert bigrams[0] == Triplet("bigram", "a", "girl") and len(bigrams) == 7
    with pytest.raises(ConfigError, match="fragments"):
        tree_triplets(TREE, "trigram")


def test_one_percent_filter_and_encoding():
    counts = {"det": 500, "prep": 400, "nsubj": 95, "rare": 5}
    assert frequent_relations(counts) == ["det", "prep", "nsubj"]
    fragments = [tree_triplets(TREE), []]
    words = {"girl": 0, "a": 1, "into": 2, "building": 3, "going": 4}
    encoded = encode_fragments(fragments, ["det", "pobj", "acl"], words)
    # det(girl, a), acl(girl, going), pobj(into, building); det(building, a); "wooden"/"." lack vectors
    assert encoded.lengths.tolist() == [4, 0] and encoded.empty.tolist() == [1]
    assert encoded.relation.dtype == np.int32 and set(encoded.relation.tolist()) == {0, 1, 2}


def _corpus(captions_per_image):
    image_ids = [f"img{i}" for i in range(len(captions_per_image))]
    captions = [c for caps in captions_per_image for c in caps]
    owner = [i for i, caps in enumerate(captions_per_image) for _ in caps]
    return CaptionCorpus(image_ids, captions, owner, source="captions.txt")


def test_caption_join_by_position_and_text_check():
    trees = {"img0#1": DependencyTree("img0.jpg#1", ("a",), (0,), ("root",), text="a"),
             "img0#0": DependencyTree("img0.jpg#0", ("b",), (0,), ("root",), text="b"),
             "other#0": DependencyTree("other.jpg#0", ("c",), (0,), ("root",), text="c")}
    assert [t.text for t in caption_trees(trees, _corpus([["b", "a"]]))] == ["b", "a"]
    with pytest.raises(DataFormatError, match="is of 'b'"):
        caption_trees(trees, _corpus([["x", "a"]]), "parses.conllu")
    with pytest.raises(DataFormatError, match="no parse of caption 'img0#2'"):
        caption_trees(trees, _corpus([["b", "a", "z"]]), "parses.conllu")


@pytest.mark.skipif(not (REAL / "Flickr8k.token.conllu").exists(), reason="needs ../shared/realdata")
def test_real_flickr8k_parses_through_fragment_extraction():
    from tf_twobranch.data.formats import read_token_file
    trees = caption_trees(read_conllu(REAL / "Flickr8k.token.conllu"),
                          read_token_file(REAL / "Flickr8k.token.txt"), REAL / "Flickr8k.token.conllu")
    assert len(trees) == 40460
    stats = {}
    for collapse in (False, True):
        fragments = [tree_triplets(t, collapse_prepositions=collapse) for t in trees]
        counts = relation_counts(fragments)
        stats[collapse] = (len(counts), len(frequent_relations(counts)),
                           sum(map(len, fragments)) / len(fragments))
    print("relation types before -> after the 1 % filter, fragments per sentence:", stats)
    # spaCy/ClearNLP labels: 43 -> 15; collapsed like CoreNLP: 110 -> 18 (the paper: 170 -> 17).
    assert stats[False][:2] == (43, 15) and stats[True][:2] == (110, 18)
    assert 9.0 < stats[True][2] < stats[False][2] < 12.0
