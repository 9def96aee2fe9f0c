import numpy as np
import pytest

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.errors import DataFormatError


def small_corpus():
    return CaptionCorpus.from_pairs(
        [("a", "a one"), ("b", "b one"), ("a", "a two"), ("c", "c one"), ("b", "b two")],
        source="pairs.txt")


def test_from_pairs_groups_by_first_appearance():
    corpus = small_corpus()
    assert corpus.image_ids == ["a", "b", "c"]
    assert corpus.captions == ["a one", "a two", "b one", "b two", "c one"]
    assert corpus.caption_image.dtype == np.int32
    assert corpus.caption_image.tolist() == [0, 0, 1, 1, 2]
    assert (corpus.num_images, corpus.num_captions) == (3, 5)
    assert corpus.captions_of("b") == ["b one", "b two"]
    assert corpus.captions_by_image() == [["a one", "a two"], ["b one", "b two"], ["c one"]]
    assert corpus.captions_per_image() is None
    assert "c" in corpus and "z" not in corpus
    corpus.validate()


def test_positive_mask_and_constant_count():
    corpus = CaptionCorpus.from_pairs([("x", "1"), ("x", "2"), ("y", "3"), ("y", "4")])
    assert corpus.captions_per_image() == 2
    mask = corpus.positive_mask()
    assert mask.dtype == bool and mask.shape == (4, 2)
    assert mask.tolist() == [[True, False], [True, False], [False, True], [False, True]]


def test_subset_keeps_order_and_names_source_of_unknown_id():
    corpus = small_corpus()
    sub = corpus.subset(["c", "a"])
    assert sub.image_ids == ["c", "a"]
    assert sub.captions == ["c one", "a one", "a two"]
    assert sub.caption_image.tolist() == [0, 1, 1]
    assert sub.source == "pairs.txt"
    with pytest.raises(DataFormatError, match=r"test\.txt.*'zz'"):
        corpus.subset(["a", "zz"], source="test.txt")
    with pytest.raises(DataFormatError, match="twice"):
        corpus.subset(["a", "a"], source="test.txt")


def test_equality_and_captions_of_unknown():
    assert small_corpus() == small_corpus()
    assert small_corpus() != small_corpus().subset(["a"])
    with pytest.raises(KeyError):
        small_corpus().captions_of("nope")


@pytest.mark.parametrize("corpus, pattern", [
    (CaptionCorpus(["a", "b"], ["x", " "], [0, 1], "f.tok"), r"f\.tok.*caption 1 of image 'b' is empty"),
    (CaptionCorpus(["a", "a"], ["x", "y"], [0, 1], "f.tok"), r"f\.tok.*'a' occurs twice"),
    (CaptionCorpus(["a"], ["x", "y"], [0, 3], "f.tok"), r"f\.tok.*caption 1 refers to image index 3"),
    (CaptionCorpus(["a", "b"], ["x", "y"], [1, 0], "f.tok"), r"caption 1 .*out of order"),
    (CaptionCorpus(["a"], ["x", "y"], [0], "f.tok"), r"2 captions but 1"),
])
def test_validate_errors(corpus, pattern):
    with pytest.raises(DataFormatError, match=pattern):
        corpus.validate()
