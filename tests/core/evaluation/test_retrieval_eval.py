"""Golden tests of the shared evaluation core against hand-computed ranks."""
import numpy as np
import pytest

from tf_twobranch.evaluation import retrieval as R


def _naive_ranks(scores, caption_image):
    """Reference: full sort per query, ties broken against the query (pessimistic)."""
    n_img, n_cap = scores.shape
    i2t = np.zeros(n_img, int)
    for i in range(n_img):
        positive = caption_image == i
        # Sort by descending score; among equal scores negatives come first.
        order = np.lexsort((positive, -scores[i]))
        i2t[i] = int(np.argmax(positive[order])) + 1
    t2i = np.zeros(n_cap, int)
    for c in range(n_cap):
        positive = np.arange(n_img) == caption_image[c]
        order = np.lexsort((positive, -scores[:, c]))
        t2i[c] = int(np.argmax(positive[order])) + 1
    return i2t, t2i


def _vsepp_i2t_t2i(image_embeds, caption_embeds):
    """An independent numpy transcription of vsepp's evaluation.i2t / t2i (cosine).

    vsepp takes images repeated 5 times (one row per caption) and 5
    consecutive captions per image; ranks are 0-based positions in
    `argsort(d)[::-1]`, the image's best over its 5 captions.
    """
    images = np.repeat(image_embeds, 5, axis=0)
    npts = images.shape[0] // 5
    i2t = np.zeros(npts)
    for index in range(npts):
        d = np.dot(images[5 * index][None, :], caption_embeds.T).flatten()
        inds = np.argsort(d)[::-1]
        i2t[index] = min(np.where(inds == i)[0][0] for i in range(5 * index, 5 * index + 5))
    ims = images[::5]
    t2i = np.zeros(5 * npts)
    for index in range(npts):
        d = np.dot(caption_embeds[5 * index:5 * index + 5], ims.T)
        for i in range(len(d)):
            inds = np.argsort(d[i])[::-1]
            t2i[5 * index + i] = np.where(inds == index)[0][0]

    def metrics(ranks):
        return {"r1": 100.0 * np.mean(ranks < 1), "r5": 100.0 * np.mean(ranks < 5),
                "r10": 100.0 * np.mean(ranks < 10), "medr": np.floor(np.median(ranks)) + 1,
                "meanr": ranks.mean() + 1}
    return i2t, t2i, metrics(i2t), metrics(t2i)


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


def _tied_embeddings(rng):
    """Small-integer embeddings: dot products are exact in float32 and tie often."""
    img = rng.integers(-2, 3, size=(40, 4)).astype(np.float32)
    txt = rng.integers(-2, 3, size=(200, 4)).astype(np.float32)
    txt[::7] = txt[1]                 # duplicated captions across images
    img[5] = img[6]                   # duplicated images
    return img, txt


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("ties", [False, True])
def test_chunked_ranks_match_naive(chunk, ties):
    rng = np.random.default_rng(0)
    if ties:
        img, txt = _tied_embeddings(rng)
    else:
        img = rng.normal(size=(40, 8)).astype(np.float32)
        txt = rng.normal(size=(200, 8)).astype(np.float32)
    cap_img = np.repeat(np.arange(40), 5)
    scores = (img.astype(np.float64) @ txt.T.astype(np.float64)).astype(np.float32)
    if ties:
        # The test must exercise ties between a positive and a negative.
        assert any(np.sum(scores[:, c] == scores[cap_img[c], c]) > 1 for c in range(200))
    i2t, t2i = R.ranks_from_embeddings(img, txt, cap_img, chunk_size=chunk)
    n_i2t, n_t2i = _naive_ranks(scores, cap_img)
    np.testing.assert_array_equal(i2t, n_i2t)
    np.testing.assert_array_equal(t2i, n_t2i)
    s_i2t, s_t2i = R.ranks_from_score_matrix(scores, cap_img)
    np.testing.assert_array_equal(s_i2t, n_i2t)
    np.testing.assert_array_equal(s_t2i, n_t2i)
    blocks_i2t, blocks_t2i = R.ranks_from_score_fn(lambda a, b: scores[:, a:b], 40, cap_img,
                                                   chunk_size=chunk)
    np.testing.assert_array_equal(blocks_i2t, n_i2t)
    np.testing.assert_array_equal(blocks_t2i, n_t2i)


def test_score_windows_fit_a_scorers_call_width():
    """A scorer scoring `columns_per_call` captions at a time gets windows of whole calls."""
    assert R.score_window(5000, 2048) == 2048
    assert R.score_window(5000, 2048, 262) == 7 * 262      # 3 windows of 7 calls: 21 calls, not 24
    assert R.score_window(100, 2048, 262) == 100
    assert R.score_window(5000, 100, 262) == 262
    rng = np.random.default_rng(5)
    cap_img = rng.permutation(np.repeat(np.arange(40), 5))
    scores = rng.normal(size=(40, 200)).astype(np.float32)
    scores[:, 7] = scores[:, 3]                            # ties across windows
    widths = []

    def score_fn(start, stop):
        widths.append(stop - start)
        return scores[:, start:stop]

    i2t, t2i = R.ranks_from_score_fn(score_fn, 40, cap_img, chunk_size=64, columns_per_call=7)
    n_i2t, n_t2i = _naive_ranks(scores, cap_img)
    np.testing.assert_array_equal(i2t, n_i2t)
    np.testing.assert_array_equal(t2i, n_t2i)
    assert set(widths) == {56} and len(widths) == 4        # 29 calls of 7 cover 200 captions: 4 x 8


@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])
def test_one_pass_ranks_with_and_without_kept_blocks(keep_bytes):
    """Both directions from one pass: kept blocks or scored again, shuffled captions, an image
    without captions, ties between positives and negatives."""
    rng = np.random.default_rng(3)
    img, txt = _tied_embeddings(rng)
    cap_img = rng.permutation(np.repeat(np.arange(40), 5))
    cap_img[cap_img == 17] = 18                      # image 17 has no caption
    scores = (img.astype(np.float64) @ txt.T.astype(np.float64)).astype(np.float32)
    n_i2t, n_t2i = _naive_ranks(scores, cap_img)
    n_i2t[17] = 0                                    # no positive: excluded from the metrics
    i2t, t2i = R.ranks_from_embeddings(img, txt, cap_img, chunk_size=13, keep_bytes=keep_bytes)
    assert i2t[17] == 0
    np.testing.assert_array_equal(i2t, n_i2t)
    np.testing.assert_array_equal(t2i, n_t2i)
    old_i2t = R.group_ranks(img, txt, np.arange(40), cap_img)
    old_t2i = R.group_ranks(txt, img, cap_img, np.arange(40))
    np.testing.assert_array_equal(i2t, old_i2t)
    np.testing.assert_array_equal(t2i, old_t2i)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranks_equal_vsepp_on_tie_free_inputs(seed):
    rng = np.random.default_rng(seed)
    img = rng.normal(size=(60, 16)).astype(np.float32)
    txt = (np.repeat(img, 5, axis=0) + 1.5 * rng.normal(size=(300, 16))).astype(np.float32)
    img /= np.linalg.norm(img, axis=1, keepdims=True)
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    v_i2t, v_t2i, v_i2t_metrics, v_t2i_metrics = _vsepp_i2t_t2i(img, txt)
    i2t, t2i = R.ranks_from_embeddings(img, txt, np.repeat(np.arange(60), 5), chunk_size=64)
    np.testing.assert_array_equal(i2t, v_i2t + 1)
    np.testing.assert_array_equal(t2i, v_t2i + 1)
    m = R.retrieval_metrics_from_ranks(i2t, t2i)
    for key in ("r1", "r5", "r10", "medr", "meanr"):
        assert m[f"i2t_{key}"] == pytest.approx(v_i2t_metrics[key])
        assert m[f"t2i_{key}"] == pytest.approx(v_t2i_metrics[key])
    # Not a trivial case: some queries miss at R@1.
    assert 0 < m["i2t_r1"] < 100 and 0 < m["t2i_r1"] < 100


def test_ties_count_against_the_query():
    images = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)   # two identical images
    texts = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    i2t, t2i = R.ranks_from_embeddings(images, texts, [0, 1])
    # Caption 0 scores 1 with both images: tie with the negative -> rank 2.
    np.testing.assert_array_equal(t2i, [2, 2])
    # Image 1's positive (caption 1) scores 0, its negative caption 0 scores 1.
    np.testing.assert_array_equal(i2t, [1, 2])


@pytest.mark.parametrize("kind", ["zeros", "constant", "constant_texts", "zero_texts"])
def test_collapsed_embeddings_score_at_or_below_chance(kind):
    rng = np.random.default_rng(0)
    n = 100
    img = rng.normal(size=(n, 16)).astype(np.float32)
    txt = rng.normal(size=(5 * n, 16)).astype(np.float32)
    constant = rng.normal(size=16).astype(np.float32)
    if kind == "zeros":
        img[:], txt[:] = 0.0, 0.0
    elif kind == "constant":
        img[:], txt[:] = constant, constant
    elif kind == "constant_texts":
        txt[:] = constant
    else:
        txt[:] = 0.0
    cap_img = np.repeat(np.arange(n), 5)
    for metrics in (R.retrieval_metrics(img, txt, cap_img),
                    R.evaluate_protocol(img, txt, cap_img, "full"),
                    R.retrieval_metrics_from_ranks(*R.ranks_from_score_matrix(img @ txt.T, cap_img))):
        # A random ranking gives i2t R@K ~ 5K/(5n) and t2i R@K ~ K/n; ties can only lower it.
        assert metrics["t2i_r1"] <= 100.0 / n + 1e-9
        assert metrics["t2i_r10"] <= 100.0 * 10 / n + 1e-9
        if kind in ("zeros", "constant", "zero_texts"):
            # every caption scores the same for every image: each query is last.
            assert metrics["i2t_r10"] == 0.0 and metrics["t2i_r10"] == 0.0
            assert metrics["rsum"] == 0.0


def test_degenerate_embeddings_are_logged(caplog):
    import logging as std_logging
    from absl import logging as absl_logging
    absl_logging.get_absl_logger().propagate = True
    with caplog.at_level(std_logging.WARNING):
        R.retrieval_metrics(np.ones((4, 3)), np.ones((8, 3)), np.repeat(np.arange(4), 2))
    assert "degenerate" in caplog.text
    caplog.clear()
    rng = np.random.default_rng(0)
    with caplog.at_level(std_logging.WARNING):
        R.retrieval_metrics(rng.normal(size=(4, 3)), rng.normal(size=(8, 3)),
                            np.repeat(np.arange(4), 2))
    assert "degenerate" not in caplog.text
    assert R.is_degenerate(np.zeros((3, 2))) and not R.is_degenerate(np.eye(3))


def test_duplicate_captions_tie_exactly():
    """Identical captions of different images tie exactly, whatever their positions."""
    rng = np.random.default_rng(4)
    img = rng.normal(size=(50, 32)).astype(np.float32)
    txt = rng.normal(size=(250, 32)).astype(np.float32)
    txt[1::5] = txt[0]            # one sentence written for every image
    cap_img = np.repeat(np.arange(50), 5)
    i2t, _ = R.ranks_from_embeddings(img, txt, cap_img, chunk_size=37)
    scores = img.astype(np.float64) @ txt.T.astype(np.float64)
    others = np.stack([scores[i, 5 * i + np.array([0, 2, 3, 4])].max() for i in range(50)])
    duplicate_is_best = scores[:, 0] > others + 1e-4
    assert duplicate_is_best.sum() >= 5
    # Where the shared sentence is an image's best caption, its 49 copies written for
    # other images tie with it and count against the image.
    assert np.all(i2t[duplicate_is_best] >= 50)
    # And every rank is the pessimistic reference's on exactly tied scores.
    scores[:, 1::5] = scores[:, [0]]
    np.testing.assert_array_equal(i2t, _naive_ranks(scores, cap_img)[0])


def test_first_caption_protocol_keeps_each_images_first_caption():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(6, 4)).astype(np.float32)
    caption_image = np.array([0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5, 2])
    texts = rng.normal(size=(len(caption_image), 4)).astype(np.float32)
    np.testing.assert_array_equal(R.first_caption_rows(caption_image), [0, 2, 5, 6, 8, 9])
    keep = R.first_caption_rows(caption_image)
    expected = R.evaluate_protocol(images, texts[keep], caption_image[keep], "full")
    assert R.evaluate_protocol(images, texts, caption_image, "first_caption") == expected
    # Index arrays (models scored through a score_fn_factory) are selected the same way.
    factory = lambda i, t: (lambda a, b: images[i] @ texts[t[a:b]].T)  # noqa: E731
    got = R.evaluate_protocol(np.arange(6), np.arange(len(caption_image)), caption_image, "first_caption",
                              score_fn_factory=factory)
    assert got == pytest.approx(expected)
