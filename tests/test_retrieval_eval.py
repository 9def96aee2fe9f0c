"""Golden tests of the shared evaluation core against hand-computed ranks."""
import numpy as np
import pytest

from tf_twobranch.evaluation import retrieval as R
from tf_twobranch.errors import UserInputError


def _naive_ranks(scores, caption_image):
    """Reference: full argsort per query (vsepp style), best rank over positives."""
    n_img, n_cap = scores.shape
    i2t = np.zeros(n_img, int)
    for i in range(n_img):
        order = np.argsort(-scores[i], kind="stable")
        pos = np.where(caption_image == i)[0]
        i2t[i] = min(np.where(order == p)[0][0] for p in pos) + 1
    t2i = np.zeros(n_cap, int)
    for c in range(n_cap):
        order = np.argsort(-scores[:, c], kind="stable")
        t2i[c] = np.where(order == caption_image[c])[0][0] + 1
    return i2t, t2i


def test_hand_computed_ranks():
    # 3 images, 2 captions each; scores chosen by hand.
    images = np.eye(3, dtype=np.float32)
    texts = np.array([
        [1.0, 0.0, 0.0],   # cap0 -> img0, rank 1
        [0.2, 0.9, 0.0],   # cap1 -> img0, img1 scores higher: rank 2
        [0.0, 1.0, 0.0],   # cap2 -> img1, rank 1
        [0.0, 0.1, 0.5],   # cap3 -> img1, img2 higher: rank 2
        [0.3, 0.0, 0.4],   # cap4 -> img2, rank 1
        [0.8, 0.6, 0.1],   # cap5 -> img2, rank 3
    ], np.float32)
    cap_img = np.array([0, 0, 1, 1, 2, 2])
    i2t, t2i = R.ranks_from_embeddings(images, texts, cap_img, chunk_size=4)
    np.testing.assert_array_equal(t2i, [1, 2, 1, 2, 1, 3])
    # img0: column scores [1.0,0.2,0,0,0.3,0.8] -> best positive cap0 at rank 1
    # img1: [0,0.9,1.0,0.1,0,0.6] -> cap2 rank 1
    # img2: [0,0,0,0.5,0.4,0.1] -> best positive cap4 (0.4) beaten by cap3 (0.5): rank 2
    np.testing.assert_array_equal(i2t, [1, 1, 2])
    m = R.retrieval_metrics_from_ranks(i2t, t2i, ks=(1, 2))
    assert m["i2t_r1"] == pytest.approx(200 / 3)
    assert m["t2i_r1"] == pytest.approx(50.0)
    assert m["t2i_r2"] == pytest.approx(500 / 6)
    # rank0 = [0,1,0,1,0,2]: median 0.5, floor 0, + 1 -> 1 (vsepp convention)
    assert m["t2i_medr"] == 1.0
    assert m["t2i_meanr"] == pytest.approx(10 / 6)

def test_medr_follows_vsepp_convention():
    m = R.metrics_from_ranks(np.array([1, 2, 2, 4]))
    # rank0 = [0,1,1,3], median 1 -> 2
    assert m["medr"] == 2.0
    assert m["meanr"] == pytest.approx(2.25)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_ranks_match_naive(chunk):
    rng = np.random.default_rng(0)
    img = rng.normal(size=(40, 8)).astype(np.float32)
    txt = rng.normal(size=(200, 8)).astype(np.float32)
    cap_img = np.repeat(np.arange(40), 5)
    i2t, t2i = R.ranks_from_embeddings(img, txt, cap_img, chunk_size=chunk)
    n_i2t, n_t2i = _naive_ranks(img @ txt.T, cap_img)
    np.testing.assert_array_equal(i2t, n_i2t)
    np.testing.assert_array_equal(t2i, n_t2i)
    s_i2t, s_t2i = R.ranks_from_score_matrix(img @ txt.T, cap_img)
    np.testing.assert_array_equal(s_i2t, n_i2t)
    np.testing.assert_array_equal(s_t2i, n_t2i)


def test_sentence_retrieval_excludes_query_itself():
    # Two images; captions of the same image are near-identical.
    txt = np.array([[1, 0], [0.99, 0.1], [0, 1], [0.1, 0.99]], np.float32)
    m = R.sentence_retrieval_metrics(txt, np.array([0, 0, 1, 1]), ks=(1,))
    assert m["s2s_r1"] == 100.0


def test_coco_1k_protocol_averages_five_folds():
    rng = np.random.default_rng(1)
    img = rng.normal(size=(5000, 4)).astype(np.float32)
    txt = np.repeat(img, 5, axis=0) + 0.5 * rng.normal(size=(25000, 4)).astype(np.float32)
    cap_img = np.repeat(np.arange(5000), 5)
    m1k = R.evaluate_protocol(img, txt, cap_img, "coco_1k")
    folds = [R.retrieval_metrics(img[f*1000:(f+1)*1000], txt[f*5000:(f+1)*5000],
                                 cap_img[f*5000:(f+1)*5000] - f*1000) for f in range(5)]
    assert m1k["i2t_r1"] == pytest.approx(np.mean([f["i2t_r1"] for f in folds]))
    m5k = R.evaluate_protocol(img, txt, cap_img, "coco_5k")
    assert m5k["t2i_r1"] < m1k["t2i_r1"]


def test_bad_inputs_are_clear():
    with pytest.raises(UserInputError, match="NaN"):
        R.retrieval_metrics(np.array([[np.nan, 1.0]]), np.ones((1, 2)), [0])
    with pytest.raises(UserInputError, match="one entry per caption"):
        R.retrieval_metrics(np.ones((2, 2)), np.ones((3, 2)), [0, 1])
    with pytest.raises(UserInputError, match="unknown protocol"):
        R.evaluate_protocol(np.ones((2, 2)), np.ones((2, 2)), [0, 1], "coco_2k")
