"""Issue 23 items 3, 4, 10: protocols checked against their split, split fingerprints,
tables that say what they show."""
from __future__ import annotations

import numpy as np
import pytest

from tf_twobranch.data.corpus import CaptionCorpus, split_fingerprint
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval


def _split(num_images: int, captions_per_image: int = 5, dim: int = 4, seed: int = 0):
    """Random d-dim images and noisy copies as captions: recalls strictly between 0 and 100."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(num_images, dim)).astype(np.float32)
    caption_image = np.repeat(np.arange(num_images, dtype=np.int32), captions_per_image)
    texts = (images[caption_image] + 0.8 * rng.normal(size=(len(caption_image), dim))).astype(np.float32)
    return images, texts, caption_image


# ------------------------------------------------------------------ item 3: protocols


def test_coco_1k_is_the_mean_of_five_1k_folds_with_their_spread():
    images, texts, caption_image = _split(5000)
    got = retrieval.evaluate_protocol(images, texts, caption_image, "coco_1k")
    folds = []
    for f in range(5):
        sel = (caption_image >= 1000 * f) & (caption_image < 1000 * (f + 1))
        folds.append(retrieval.evaluate_protocol(images[1000 * f:1000 * (f + 1)], texts[sel],
                                                 caption_image[sel] - 1000 * f, "full"))
    assert got["num_folds"] == 5
    assert len({m["i2t_r1"] for m in folds}) > 1          # the folds differ, so the spread is > 0
    for key in folds[0]:
        assert got[key] == pytest.approx(np.mean([m[key] for m in folds])), key
        assert got[f"{key}_fold_std"] == pytest.approx(np.std([m[key] for m in folds])), key
    assert got["rsum_fold_std"] > 0
    five_k = retrieval.evaluate_protocol(images, texts, caption_image, "coco_5k")
    assert five_k == retrieval.evaluate_protocol(images, texts, caption_image, "full")
    assert "num_folds" not in five_k
    assert got["i2t_r1"] > five_k["i2t_r1"]               # a 1K gallery is easier than the 5K one


@pytest.mark.parametrize("protocol, size, expected", [
    ("coco_5k", 4999, "exactly 5000"), ("coco_1k", 1000, r"exactly 5000 test images \(5 folds of 1000\)"),
    ("flickr30k_1k", 962, "exactly 1000"), ("folds_100", 99, "at least 100")])
def test_a_protocol_on_a_split_of_the_wrong_size_is_refused(protocol, size, expected):
    images, texts, caption_image = _split(size, captions_per_image=1)
    with pytest.raises(UserInputError, match=f"protocol {protocol} needs {expected}.*has {size}"):
        retrieval.evaluate_protocol(images, texts, caption_image, protocol)
    with pytest.raises(UserInputError, match=f"protocol {protocol}"):
        retrieval.random_baseline_metrics(size, caption_image, protocol=protocol)


def test_protocols_agree_only_when_measured_the_same_way():
    assert retrieval.protocols_agree("coco_5k", 5000, "coco_5k")
    assert retrieval.protocols_agree("full", 5000, "coco_5k")        # one gallery of 5,000
    assert retrieval.protocols_agree("full", 1000, "flickr30k_1k")
    assert not retrieval.protocols_agree("coco_5k", 5000, "coco_1k")
    assert not retrieval.protocols_agree("full", 1000, "coco_1k")    # 1K means five folds
    assert not retrieval.protocols_agree("full", 120, "flickr30k_1k")
    assert not retrieval.protocols_agree("full", 1000, "")           # undeclared


def test_split_fingerprint_changes_with_order_captions_and_assignment():
    corpus = CaptionCorpus.from_pairs([("a", "a dog"), ("a", "a cat"), ("b", "two birds")])
    base = corpus.fingerprint()
    assert base == CaptionCorpus.from_pairs([("a", "a dog"), ("a", "a cat"), ("b", "two birds")]).fingerprint()
    assert base != corpus.subset(["b", "a"]).fingerprint()
    assert base != CaptionCorpus.from_pairs([("a", "a dog"), ("a", "a cat"), ("b", "two bird")]).fingerprint()
    assert base != CaptionCorpus.from_pairs([("a", "a dog"), ("b", "a cat"), ("b", "two birds")]).fingerprint()
    assert base != split_fingerprint(["a", "b"], ["a dog", "a cat"], [0, 0])
