"""Localization volume and its scores (Das et al. eq. 1) against brute-force Python loops."""
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.systems.npair import heat_map_volume as lv


def random_inputs(seed=0, images=3, captions=4, height=2, width=3, tokens=5, depth=4):
    rng = np.random.default_rng(seed)
    maps = rng.normal(size=(images, height, width, depth)).astype(np.float32)
    vectors = rng.normal(size=(captions, tokens, depth)).astype(np.float32)
    lengths = np.array([tokens, 1, 3, 2, 4, 1][:captions])
    mask = np.arange(tokens)[None, :] < lengths[:, None]
    # Padded positions carry large vectors: any leak into a "real" score shows.
    vectors[~mask] *= 50.0
    return maps, vectors, mask


def brute_score(image_map, tokens, mask, aggregator, token_average):
    """S(I, T) by explicit loops over locations and tokens (paper eq. 1 and the code's variants)."""
    height, width, _ = image_map.shape
    used = [t for t in range(len(tokens)) if token_average == "all" or mask[t]]
    if not used:
        return 0.0
    m = {}
    for r in range(height):
        for c in range(width):
            for t in used:
                m[r, c, t] = float(np.dot(image_map[r, c].astype(np.float64), tokens[t]))
    if aggregator == "max_image":
        return sum(max(m[r, c, t] for r in range(height) for c in range(width)) for t in used) / len(used)
    if aggregator == "max_text":
        return sum(max(m[r, c, t] for t in used) for r in range(height) for c in range(width)) \
            / (height * width)
    if aggregator == "mean_all":
        return sum(m.values()) / (height * width * len(used))
    assert aggregator == "max_rows_code"
    return sum(max(m[r, c, t] for r in range(height)) for c in range(width) for t in used) \
        / (width * len(used))


def brute_matrix(maps, vectors, mask, aggregator, token_average):
    return np.array([[brute_score(maps[i], vectors[j], mask[j], aggregator, token_average)
                      for j in range(len(vectors))] for i in range(len(maps))])


@pytest.mark.parametrize("token_average", lv.TOKEN_AVERAGES)
@pytest.mark.parametrize("aggregator", lv.AGGREGATORS)
def test_pairwise_and_paired_match_loops(aggregator, token_average):
    maps, vectors, mask = random_inputs()
    expected = brute_matrix(maps, vectors, mask, aggregator, token_average)
    got = lv.pairwise_localization_scores(maps, vectors, mask, aggregator=aggregator,
                                          token_average=token_average).numpy()
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    paired = lv.paired_localization_scores(maps, vectors[:3], mask[:3], aggregator=aggregator,
                                           token_average=token_average).numpy()
    np.testing.assert_allclose(paired, np.diag(expected[:, :3]), rtol=1e-5, atol=1e-4)


def test_localization_volume_is_the_dot_product_of_every_location_and_token():
    maps, vectors, _ = random_inputs(images=2, captions=2)
    got = lv.localization_volume(maps, vectors).numpy()
    assert got.shape == (2, 2, 3, 5)
    for b in range(2):
        for r in range(2):
            for c in range(3):
                for t in range(5):
                    np.testing.assert_allclose(got[b, r, c, t], maps[b, r, c] @ vectors[b, t],
                                               rtol=1e-5, atol=1e-5)


def test_padded_token_never_wins_a_max():
    # One location, real token scores 1, padded token scores 100.
    image = np.ones((1, 1, 1, 1), np.float32)
    tokens = np.array([[[1.0], [100.0]]], np.float32)
    mask = np.array([[True, False]])
    for aggregator in lv.AGGREGATORS:
        real = lv.pairwise_localization_scores(image, tokens, mask, aggregator=aggregator)
        assert float(real[0, 0]) == pytest.approx(1.0), aggregator
    every = lv.pairwise_localization_scores(image, tokens, mask, aggregator="max_text",
                                            token_average="all")
    assert float(every[0, 0]) == pytest.approx(100.0)
    negative = lv.pairwise_localization_scores(-image, tokens, mask, aggregator="max_text")
    assert float(negative[0, 0]) == pytest.approx(-1.0)


def test_caption_without_real_token_scores_zero():
    maps, vectors, mask = random_inputs()
    mask[1] = False
    for aggregator in lv.AGGREGATORS:
        scores = lv.pairwise_localization_scores(maps, vectors, mask, aggregator=aggregator).numpy()
        assert np.all(np.isfinite(scores))
        np.testing.assert_array_equal(scores[:, 1], 0.0)
        paired = lv.paired_localization_scores(maps, vectors[:3], mask[:3],
                                               aggregator=aggregator).numpy()
        assert paired[1] == 0.0


def test_max_rows_code_differs_from_max_image_on_a_hand_made_case():
    # A 2x2 map and one token s = [1]: m = [[0, 3], [1, 0]].
    image = np.array([[[[0.0], [3.0]], [[1.0], [0.0]]]], np.float32)
    tokens = np.ones((1, 1, 1), np.float32)
    mask = np.ones((1, 1), bool)
    max_image = float(lv.pairwise_localization_scores(image, tokens, mask)[0, 0])
    rows_only = float(lv.pairwise_localization_scores(image, tokens, mask,
                                                      aggregator="max_rows_code")[0, 0])
    assert max_image == pytest.approx(3.0)            # the spatial max
    assert rows_only == pytest.approx((1.0 + 3.0) / 2)  # column maxima 1 and 3, averaged


def test_non_square_map_rows_and_columns_are_not_swapped():
    # H=1, W=3: the max over rows is the identity, so max_rows_code = mean_all.
    maps, vectors, mask = random_inputs(height=1, width=3)
    a = lv.pairwise_localization_scores(maps, vectors, mask, aggregator="max_rows_code")
    b = lv.pairwise_localization_scores(maps, vectors, mask, aggregator="mean_all")
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


def test_normalisation_vector_mode():
    maps = np.zeros((1, 1, 2, 2), np.float32)
    maps[0, 0, 0] = [3.0, 4.0]                          # location 1 stays zero
    tokens = np.array([[[0.0, 2.0], [5.0, 0.0]]], np.float32)
    mask = np.array([[True, False]])
    got_maps, got_tokens = lv.normalise_localization_inputs(maps, tokens, mask, "vector")
    np.testing.assert_allclose(got_maps.numpy()[0, 0], [[0.6, 0.8], [0.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(got_tokens.numpy()[0], [[0.0, 1.0], [1.0, 0.0]], atol=1e-6)


def test_normalisation_map_mode():
    maps = np.zeros((2, 1, 2, 2), np.float32)
    maps[0, 0, 0] = [1.0, 2.0]
    maps[0, 0, 1] = [2.0, 4.0]                          # Frobenius norm 5
    tokens = np.array([[[3.0, 0.0], [0.0, 4.0], [7.0, 7.0]],
                       [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]], np.float32)
    mask = np.array([[True, True, False], [False, False, False]])
    got_maps, got_tokens = lv.normalise_localization_inputs(maps, tokens, mask, "map")
    np.testing.assert_allclose(got_maps.numpy()[0], maps[0] / 5.0, atol=1e-6)
    np.testing.assert_array_equal(got_maps.numpy()[1], 0.0)        # an all-zero map stays zero
    # LocNet's norm runs over every position, padding included (sqrt(9 + 16 + 49 + 49)), not the
    # real tokens' 5; the mask does not enter, so a caption without a real token is scaled too.
    np.testing.assert_allclose(got_tokens.numpy()[0], tokens[0] / np.sqrt(123.0), atol=1e-6)
    np.testing.assert_allclose(got_tokens.numpy()[1], tokens[1] / np.sqrt(6.0), atol=1e-6)
    none_maps, none_tokens = lv.normalise_localization_inputs(maps, tokens, mask, "none")
    np.testing.assert_array_equal(none_maps.numpy(), maps)
    np.testing.assert_array_equal(none_tokens.numpy(), tokens)


def test_gradients_are_finite():
    maps, vectors, mask = random_inputs()
    mask[2] = False
    maps[0, 0, 0] = 0.0
    maps_t, vectors_t = tf.constant(maps), tf.constant(vectors)
    for mode in lv.NORMALISATIONS:
        for aggregator in lv.AGGREGATORS:
            with tf.GradientTape() as tape:
                tape.watch([maps_t, vectors_t])
                a, s = lv.normalise_localization_inputs(maps_t, vectors_t, mask, mode)
                total = tf.reduce_sum(lv.pairwise_localization_scores(a, s, mask,
                                                                      aggregator=aggregator))
            grads = tape.gradient(total, [maps_t, vectors_t])
            for g in grads:
                assert np.all(np.isfinite(g.numpy())), (mode, aggregator)
            # Padded tokens get no gradient under token_average="real", except through the "map"
            # norm, which counts every position (as LocNet's).
            if mode != "map":
                assert np.all(grads[1].numpy()[~mask] == 0.0), (mode, aggregator)


@pytest.mark.parametrize("aggregator", lv.AGGREGATORS)
def test_xla_gives_the_same_values(aggregator):
    maps, vectors, mask = random_inputs(seed=3)
    mask[0] = False

    @tf.function(jit_compile=True)
    def compiled(a, s, m):
        return (lv.pairwise_localization_scores(a, s, m, aggregator=aggregator),
                lv.paired_localization_scores(a, s[:3], m[:3], aggregator=aggregator))

    pairwise, paired = compiled(tf.constant(maps), tf.constant(vectors), tf.constant(mask))
    np.testing.assert_allclose(pairwise.numpy(),
                               lv.pairwise_localization_scores(maps, vectors, mask,
                                                               aggregator=aggregator).numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(paired.numpy(), np.diag(pairwise.numpy()[:, :3]), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors():
    maps, vectors, mask = random_inputs()
    with pytest.raises(ConfigError, match="aggregator"):
        lv.pairwise_localization_scores(maps, vectors, mask, aggregator="max")
    with pytest.raises(ConfigError, match="token_average"):
        lv.pairwise_localization_scores(maps, vectors, mask, token_average="some")
    with pytest.raises(ConfigError, match="normalisation"):
        lv.normalise_localization_inputs(maps, vectors, mask, "l2")
    with pytest.raises(UserInputError, match="depth"):
        lv.pairwise_localization_scores(maps, vectors[..., :3], mask)
    with pytest.raises(UserInputError, match="token mask"):
        lv.pairwise_localization_scores(maps, vectors, mask[:, :2])
    with pytest.raises(UserInputError, match="image maps"):
        lv.pairwise_localization_scores(maps[0], vectors, mask)


def test_packed_max_image_scores_equal_the_padded_scores():
    maps, vectors, mask = random_inputs(seed=5)
    expected = lv.pairwise_localization_scores(maps, vectors, mask).numpy()
    counts = mask.sum(axis=1)
    packed = np.concatenate([vectors[mask], np.zeros((3, 4), np.float32)])   # 3 unused slots
    slot_index = np.full((4, 5), len(packed), np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    for k, n in enumerate(counts):
        slot_index[k, :n] = np.arange(offsets[k], offsets[k] + n)
    got = lv.packed_max_image_scores(maps, packed, slot_index, counts).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="score_dtype"):
        lv.packed_max_image_scores(maps, packed, slot_index, counts, score_dtype="float16")
    fast = lv.packed_max_image_scores(maps, packed, slot_index, counts, score_dtype="bfloat16")
    np.testing.assert_allclose(fast.numpy(), expected, rtol=0.02, atol=0.05)
