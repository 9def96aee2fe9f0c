"""Retrieval with the localization-volume score: chunked scorer, ranks and the folds_100 protocol."""
import numpy as np
import pytest

from tests.systems.npair.test_localization_volume import brute_matrix
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.systems.npair import retrieval as lr
from tf_twobranch.evaluation import retrieval


def gallery(seed=0, images=7, captions_per_image=2, height=2, width=2, tokens=4, depth=3):
    rng = np.random.default_rng(seed)
    maps = rng.normal(size=(images, height, width, depth)).astype(np.float32)
    caption_image = np.repeat(np.arange(images), captions_per_image)
    # Captions near their image's mean vector, so retrieval is better than chance.
    vectors = (maps.mean(axis=(1, 2))[caption_image][:, None, :]
               + rng.normal(size=(len(caption_image), tokens, depth))).astype(np.float32)
    lengths = rng.integers(1, tokens + 1, size=len(caption_image))
    mask = np.arange(tokens)[None, :] < lengths[:, None]
    return maps, vectors, mask, caption_image


def numpy_ranks(scores, caption_image):
    """1 + the number of wrong items scoring at least the (best) positive, per image and caption."""
    num_images, num_captions = scores.shape
    text_ranks = np.array([1 + sum(scores[i, c] >= scores[caption_image[c], c]
                                   for i in range(num_images) if i != caption_image[c])
                           for c in range(num_captions)])
    image_ranks = []
    for i in range(num_images):
        mine = [c for c in range(num_captions) if caption_image[c] == i]
        best = max(scores[i, c] for c in mine)
        image_ranks.append(1 + sum(scores[i, c] >= best for c in range(num_captions)
                                   if caption_image[c] != i))
    return np.array(image_ranks), text_ranks


@pytest.mark.parametrize("aggregator, token_average", [("max_image", "real"), ("max_text", "all"),
                                                       ("max_rows_code", "real")])
def test_chunked_scorer_equals_the_full_matrix(aggregator, token_average):
    maps, vectors, mask, _ = gallery()
    full = brute_matrix(maps, vectors, mask, aggregator, token_average)
    score = lr.localization_score_fn(maps, vectors, mask, aggregator=aggregator,
                                     token_average=token_average, image_chunk=3, caption_chunk=4)
    np.testing.assert_allclose(score(0, 14), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(score(3, 12), full[:, 3:12], rtol=1e-5, atol=1e-5)
    # A fold: chosen images and captions, in their given order.
    images, sentences = np.array([5, 1, 2, 6, 0]), np.array([9, 2, 3, 13, 0, 4])
    fold = lr.localization_score_fn(maps, vectors, mask, images=images, sentences=sentences,
                                    aggregator=aggregator, token_average=token_average,
                                    image_chunk=2, caption_chunk=4)
    np.testing.assert_allclose(fold(1, 6), full[images][:, sentences[1:6]], rtol=1e-5, atol=1e-5)


def test_ranks_and_metrics_equal_a_numpy_reference():
    maps, vectors, mask, caption_image = gallery(seed=1)
    full = brute_matrix(maps, vectors, mask, "max_image", "real")
    expected_i2t, expected_t2i = numpy_ranks(full, caption_image)
    assert 1 < expected_t2i.max()                      # not a trivial gallery
    score = lr.localization_score_fn(maps, vectors, mask, image_chunk=4, caption_chunk=3)
    i2t, t2i = retrieval.ranks_from_score_fn(score, len(maps), caption_image, chunk_size=5)
    np.testing.assert_array_equal(i2t, expected_i2t)
    np.testing.assert_array_equal(t2i, expected_t2i)
    metrics = lr.evaluate_localization_retrieval(maps, vectors, mask, caption_image, ks=(1, 5),
                                                 chunk_size=5)
    for prefix, ranks in (("i2t_", expected_i2t), ("t2i_", expected_t2i)):
        for k in (1, 5):
            assert metrics[f"{prefix}r{k}"] == pytest.approx(100.0 * np.mean(ranks <= k))
        assert metrics[f"{prefix}medr"] == pytest.approx(np.floor(np.median(ranks - 1)) + 1)
        assert metrics[f"{prefix}meanr"] == pytest.approx(ranks.mean())


def test_folds_100_on_250_images_averages_two_folds():
    maps, vectors, mask, caption_image = gallery(seed=2, images=250, captions_per_image=1,
                                                 height=1, width=2, tokens=2, depth=2)
    got = lr.evaluate_localization_retrieval(maps, vectors, mask, caption_image, "folds_100",
                                             chunk_size=64)
    folds = []
    for lo in (0, 100):
        rows = np.arange(lo, lo + 100)                 # one caption per image: same indices
        full = brute_matrix(maps[rows], vectors[rows], mask[rows], "max_image", "real")
        i2t, t2i = numpy_ranks(full, np.arange(100))
        folds.append({"i2t_r1": 100.0 * np.mean(i2t <= 1), "t2i_r10": 100.0 * np.mean(t2i <= 10),
                      "t2i_meanr": t2i.mean()})
    assert folds[0] != folds[1]                        # the average says which folds it used
    for key in folds[0]:
        assert got[key] == pytest.approx(np.mean([f[key] for f in folds])), key
    assert retrieval.PROTOCOLS["folds_100"].fold_images == 100


def test_bad_inputs_are_clear_errors():
    maps, vectors, mask, caption_image = gallery()
    with pytest.raises(UserInputError, match="token mask"):
        lr.localization_score_fn(maps, vectors, mask[:, :2])
    with pytest.raises(UserInputError, match="token vectors"):
        lr.evaluate_localization_retrieval(maps, vectors[..., :2], mask, caption_image)
    with pytest.raises(ConfigError, match="aggregator"):
        lr.localization_score_fn(maps, vectors, mask, aggregator="sum")
    with pytest.raises(ConfigError, match="caption_chunk"):
        lr.localization_score_fn(maps, vectors, mask, caption_chunk=0)
    bad = maps.copy()
    bad[0, 0, 0, 0] = np.nan
    # The gallery is read (and checked) chunk by chunk as it is scored, never whole up front.
    score = lr.localization_score_fn(bad, vectors, mask)
    with pytest.raises(UserInputError, match=r"image maps have NaN/inf values \(row 0\)"):
        score(0, 4)
    bad_tokens = vectors.copy()
    bad_tokens[3, 0, 0] = np.inf                       # a real token (every caption has one)
    with pytest.raises(UserInputError, match=r"token vectors have NaN/inf values \(row 3\)"):
        lr.localization_score_fn(maps, bad_tokens, mask)(0, 14)
    padded = vectors.copy()
    padded[~mask] = np.nan                             # padded positions are never read under "real"
    np.testing.assert_array_equal(lr.localization_score_fn(maps, padded, mask)(0, 14),
                                  lr.localization_score_fn(maps, vectors, mask)(0, 14))
    with pytest.raises(ConfigError, match="score_dtype"):
        lr.localization_score_fn(maps, vectors, mask, aggregator="max_text", score_dtype="bfloat16")


def test_packed_scores_do_not_depend_on_the_block_and_read_memory_maps(tmp_path):
    """A caption scores bit-identically in every window and packing; memmapped inputs are read
    chunk by chunk and give the in-memory scores."""
    maps, vectors, mask, _ = gallery(seed=3, images=9, captions_per_image=3, tokens=6, depth=8)
    full = brute_matrix(maps, vectors, mask, "max_image", "real")
    score = lr.localization_score_fn(maps, vectors, mask, image_chunk=4, caption_chunk=3)
    whole = score(0, 27)
    np.testing.assert_allclose(whole, full, rtol=1e-5, atol=1e-5)
    for start in (1, 5, 13):                           # other windows: other packings of the tokens
        np.testing.assert_array_equal(score(start, start + 14), whole[:, start:start + 14])
    # Duplicated captions tie exactly wherever they sit.
    twice = np.concatenate([vectors, vectors[::-1]])
    both = lr.localization_score_fn(maps, twice, np.concatenate([mask, mask[::-1]]),
                                    image_chunk=4, caption_chunk=3)(0, 54)
    np.testing.assert_array_equal(both[:, :27], both[:, 27:][:, ::-1])
    np.save(tmp_path / "maps.npy", maps)
    np.save(tmp_path / "vectors.npy", vectors.astype(np.float16))
    mapped = lr.localization_score_fn(np.load(tmp_path / "maps.npy", mmap_mode="r"),
                                      np.load(tmp_path / "vectors.npy", mmap_mode="r"), mask,
                                      image_chunk=4, caption_chunk=3)
    half = lr.localization_score_fn(maps, vectors.astype(np.float16).astype(np.float32), mask,
                                    image_chunk=4, caption_chunk=3)
    np.testing.assert_array_equal(mapped(0, 27), half(0, 27))


def test_bfloat16_scores_are_close_and_rank_alike():
    maps, vectors, mask, caption_image = gallery(seed=4, images=30, captions_per_image=2,
                                                 height=3, width=3, tokens=6, depth=32)
    exact = lr.localization_score_fn(maps, vectors, mask)(0, 60)
    fast = lr.localization_score_fn(maps, vectors, mask, score_dtype="bfloat16")(0, 60)
    assert fast.dtype == np.float32
    # bf16 keeps 8 significant bits: inputs and each location's product rounded.
    np.testing.assert_allclose(fast, exact, rtol=0, atol=0.02 * np.abs(exact).max())
    metrics = {dtype: lr.evaluate_localization_retrieval(maps, vectors, mask, caption_image,
                                                         score_dtype=dtype, chunk_size=16)
               for dtype in ("float32", "bfloat16")}
    assert abs(metrics["float32"]["rsum"] - metrics["bfloat16"]["rsum"]) <= 20
