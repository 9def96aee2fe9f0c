"""Fragment embedding model (Karpathy et al. 2014): encoders, training step, chunked S_kl evaluation."""
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.fragments.retrieval import (distinct_rows, evaluate_fragment_retrieval,
                                                        fragment_score_fn)
from tf_twobranch.systems.fragments.losses import global_scores
from tf_twobranch.systems.fragments.model import (FragmentEmbeddingConfig, FragmentEmbeddingModel,
                                                    build_fragment_model)

CONFIG = dict(image_dim=7, num_relations=3, vocabulary_size=11, word_dim=4, embed_dim=5,
              global_margin=0.1)


def _batch(rng, b=4, m=3, f=5):
    sentence_mask = rng.random((b, f)) < 0.8
    sentence_mask[:, 0] = True
    return {"image_fragments": rng.normal(size=(b, m, 7)).astype(np.float32),
            "image_mask": np.ones((b, m), bool),
            "relation": rng.integers(0, 3, (b, f)).astype(np.int32),
            "word1": rng.integers(0, 11, (b, f)).astype(np.int32),
            "word2": rng.integers(0, 11, (b, f)).astype(np.int32),
            "sentence_mask": sentence_mask}


@pytest.mark.parametrize("shared", [False, True])
def test_sentence_fragment_is_relu_of_the_relation_weights(shared):
    rng = np.random.default_rng(0)
    words = rng.normal(size=(11, 4)).astype(np.float32)
    model = build_fragment_model(FragmentEmbeddingConfig(**CONFIG, shared_relation_weights=shared), words)
    rel, w1, w2 = np.array([0, 2, 1]), np.array([3, 4, 10]), np.array([1, 1, 0])
    got = model.embed_sentence_fragments(rel, w1, w2).numpy()
    kernel = model.sentence_encoder.relation_kernel.numpy()
    bias = model.sentence_encoder.relation_bias.numpy()
    for i in range(3):
        r = 0 if shared else rel[i]
        x = np.concatenate([words[w1[i]], words[w2[i]]])
        np.testing.assert_allclose(got[i], np.maximum(0, x @ kernel[r] + bias[r]), rtol=1e-5, atol=1e-6)
    assert not model.sentence_encoder.word_vectors.trainable   # W_e stays fixed


def test_training_lowers_the_objective_and_mil_can_be_switched_on(tmp_path):
    import keras
    rng = np.random.default_rng(1)
    batch = _batch(rng)
    model = build_fragment_model(FragmentEmbeddingConfig(**CONFIG), rng.normal(size=(11, 4)))
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    first = float(model.objective(batch)["loss"])
    data = tf.data.Dataset.from_tensors(batch).repeat(30)
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    assert float(model.objective(batch)["loss"]) < first
    model.mil.assign(True)
    logs = model.fit(tf.data.Dataset.from_tensors(batch).repeat(2), epochs=1, verbose=0,
                     shuffle=False).history
    assert np.isfinite(logs["fragment_objective"][0])
    # Weights and configuration round-trip.
    model.save_config(tmp_path / "config.json", relations=["a", "b", "c"])
    model.save_weights(tmp_path / "w.weights.h5")
    config, extra = FragmentEmbeddingModel.load_config(tmp_path / "config.json")
    again = build_fragment_model(config)
    again.load_weights(tmp_path / "w.weights.h5")
    assert extra["relations"] == ["a", "b", "c"]
    np.testing.assert_allclose(again(batch).numpy(), model(batch).numpy(), rtol=1e-6)


def _ragged(rng, num_sentences, h, max_len=6):
    lengths = rng.integers(0, max_len + 1, num_sentences)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    return rng.normal(size=(splits[-1], h)).astype(np.float32), splits


def test_chunked_scores_equal_the_brute_force_double_sum():
    rng = np.random.default_rng(2)
    n_img, m, h = 7, 4, 3
    v = rng.normal(size=(n_img, m, h)).astype(np.float32)
    vm = rng.random((n_img, m)) < 0.8
    vm[:, 0] = True
    s, splits = _ragged(rng, 23, h)
    got = fragment_score_fn(v, vm, s, splits, fragment_chunk=4, image_chunk=3)(0, 23)
    want = np.zeros((n_img, 23))
    for k in range(n_img):
        for l in range(23):
            frags = s[splits[l]:splits[l + 1]]
            total = sum(max(0.0, float(v[k, i] @ f)) for i in range(m) if vm[k, i] for f in frags)
            want[k, l] = total / (vm[k].sum() * (len(frags) + 5.0))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _brute_force_scores(v, vm, s, splits, images, sentences, smoothing=5.0, normaliser="paper"):
    want = np.zeros((len(images), len(sentences)))
    for a, k in enumerate(images):
        for b, l in enumerate(sentences):
            frags = s[splits[l]:splits[l + 1]]
            total = sum(max(0.0, float(v[k, i] @ f)) for i in range(v.shape[1]) if vm[k, i] for f in frags)
            norm = len(frags) + smoothing
            want[a, b] = total / (norm * vm[k].sum() if normaliser == "paper" else norm)
    return want


@pytest.mark.parametrize("normaliser", ["paper", "code"])
def test_shared_fragments_score_once_and_equal_the_double_sum(normaliser):
    # Real captions repeat triplets ("a dog"): rows drawn from a small pool,
    # a sentence holding one fragment twice, empty sentences, a window of the
    # core and a subset of images.
    rng = np.random.default_rng(5)
    n_img, m, h = 9, 5, 4
    v = rng.normal(size=(n_img, m, h)).astype(np.float32)
    vm = rng.random((n_img, m)) < 0.7
    vm[:, 0] = True
    pool = rng.normal(size=(6, h)).astype(np.float32)
    lengths = rng.integers(0, 7, 30)
    lengths[[3, 17]] = 0
    splits = np.concatenate([[0], np.cumsum(lengths)])
    s = pool[rng.integers(0, len(pool), splits[-1])]
    s[splits[5]:splits[5] + 2] = pool[1]
    images, sentences = np.array([8, 0, 3, 4, 6]), rng.permutation(30)[:20]
    score = fragment_score_fn(v, vm, s, splits, images=images, sentences=sentences,
                              normaliser=normaliser, smoothing=10.0, fragment_chunk=2, image_chunk=2)
    got = np.concatenate([score(0, 7), score(7, 20)], axis=1)
    want = _brute_force_scores(v, vm, s, splits, images, sentences, smoothing=10.0, normaliser=normaliser)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_identical_captions_tie_exactly():
    # Caption 3 repeats caption 0's fragments in another order (another image's
    # caption): same multiset of rows, so bit-identical scores, and the core's
    # pessimistic tie rule counts the duplicate against each caption's query.
    rng = np.random.default_rng(6)
    v = rng.normal(size=(4, 3, 8)).astype(np.float32)
    vm = np.ones((4, 3), bool)
    own = rng.normal(size=(3, 8)).astype(np.float32)
    s = np.concatenate([own, rng.normal(size=(4, 8)).astype(np.float32), own[::-1]])
    splits = np.array([0, 3, 5, 7, 10])
    scores = fragment_score_fn(v, vm, s, splits, fragment_chunk=2)(0, 4)
    np.testing.assert_array_equal(scores[:, 0], scores[:, 3])


def test_distinct_rows_are_bit_for_bit():
    rows = np.array([[1.0, 2.0], [0.5, 0.0], [1.0, 2.0], [1.0, 2.0000002], [0.5, 0.0]], np.float32)
    distinct, inverse = distinct_rows(rows)
    assert len(distinct) == 3
    np.testing.assert_array_equal(distinct[inverse], rows)
    assert inverse[0] == inverse[2] and inverse[1] == inverse[4] and inverse[3] != inverse[0]
    empty, none = distinct_rows(np.zeros((0, 2), np.float32))
    assert empty.shape == (0, 2) and none.shape == (0,)


def test_fragment_retrieval_uses_the_evaluation_core():
    rng = np.random.default_rng(3)
    v = rng.normal(size=(6, 2, 3)).astype(np.float32)
    vm = np.ones((6, 2), bool)
    s, splits = _ragged(rng, 12, 3)
    caption_image = np.repeat(np.arange(6), 2)
    got = evaluate_fragment_retrieval(v, vm, s, splits, caption_image)
    padded_scores = fragment_score_fn(v, vm, s, splits)(0, 12)
    i2t, t2i = retrieval.ranks_from_score_matrix(padded_scores, caption_image)
    assert got == retrieval.retrieval_metrics_from_ranks(i2t, t2i)
    # A model that scores everything 0 (no positive score) ranks at or below chance.
    zero = evaluate_fragment_retrieval(-np.abs(v), vm, np.abs(s), splits, caption_image)
    assert zero["i2t_r1"] == 0.0 and zero["t2i_r1"] == 0.0


def test_global_scores_of_the_model_call_are_eq6():
    rng = np.random.default_rng(4)
    batch = _batch(rng)
    model = build_fragment_model(FragmentEmbeddingConfig(**CONFIG), rng.normal(size=(11, 4)))
    v = model.embed_image_fragments(batch["image_fragments"])
    s = model.embed_sentence_fragments(batch["relation"], batch["word1"], batch["word2"])
    np.testing.assert_allclose(model(batch).numpy(),
                               global_scores(v, batch["image_mask"], s, batch["sentence_mask"]).numpy(),
                               rtol=1e-6)
