"""Tests for tf_twobranch.features.text_features."""
import numpy as np
import pytest
from scipy.stats import norm

from tests.support.forked_modules import run_python
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features.text_features import (FisherVectorEncoder, MeanWordVectorEncoder, TfidfEncoder,
                                                 build_text_encoder, fisher_vectors, fit_hglmm,
                                                 load_text_encoder)
from tf_twobranch.data.formats.word_vectors import WordVectors

WORDS = ["a", "dog", "cat", "runs", "sits", "red", "car", "road", "the", "big"]


@pytest.fixture(scope="module")
def word_vectors():
    rng = np.random.default_rng(1)
    return WordVectors(WORDS, rng.normal(size=(len(WORDS), 3)).astype(np.float32))


@pytest.fixture(scope="module")
def sentences():
    rng = np.random.default_rng(2)
    return [list(rng.choice(WORDS, size=rng.integers(2, 7))) for _ in range(60)]


def test_mean_vector(word_vectors):
    encoder = MeanWordVectorEncoder(word_vectors).fit([["dog"]])
    out = encoder.transform([["dog", "cat", "zebra"], ["zebra"], []])
    assert out.shape == (3, 3) and out.dtype == np.float32
    np.testing.assert_allclose(out[0], (word_vectors["dog"] + word_vectors["cat"]) / 2, rtol=1e-6)
    np.testing.assert_array_equal(out[1:], 0.0)


def test_tfidf_removes_stop_words_and_weights_rare_words():
    train = [["a", "dog", "runs"], ["the", "dog", "sits"], ["a", "cat", "sits"], ["the", "red", "car"]]
    encoder = TfidfEncoder(max_features=3).fit(train)
    assert encoder.output_dim == 3
    assert "a" not in encoder.vocabulary and "the" not in encoder.vocabulary
    out = encoder.transform([["dog", "sits", "unknownword"], ["the"]])
    assert out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out[0]), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(out[1], 0.0)
    with pytest.raises(ConfigError, match="not fitted"):
        TfidfEncoder().transform([["dog"]])
    with pytest.raises(ConfigError, match="token lists"):
        encoder.transform(["a dog runs"])


@pytest.mark.parametrize("mixture", ["gmm", "hglmm"])
def test_fisher_vector_dimension_and_normalisation(word_vectors, sentences, mixture):
    encoder = FisherVectorEncoder(word_vectors, num_components=2, mixture=mixture, seed=0).fit(sentences)
    out = encoder.transform(sentences[:5] + [["zebra"]])
    assert out.shape == (6, 2 * 2 * 3) == (6, encoder.output_dim)
    np.testing.assert_allclose(np.linalg.norm(out[:5], axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(out[5], 0.0)  # no known word


def test_fisher_vector_matches_hand_computation_for_toy_gmm():
    weights = np.array([0.3, 0.7])
    means = np.array([[0.0, 1.0], [2.0, -1.0]])
    variances = np.array([[1.0, 0.5], [2.0, 1.5]])
    x = np.array([[0.5, 0.2], [1.5, -0.5], [3.0, 0.0]])
    # Hand computation, one word and one component at a time.
    lik = np.array([[w * np.prod(norm.pdf(xi, m, np.sqrt(v))) for w, m, v in zip(weights, means, variances)]
                    for xi in x])
    gamma = lik / lik.sum(axis=1, keepdims=True)
    n = len(x)
    g_mu, g_sigma = [], []
    for k in range(2):
        sigma = np.sqrt(variances[k])
        g_mu.append(sum(gamma[i, k] * (x[i] - means[k]) / sigma for i in range(n)) / (n * np.sqrt(weights[k])))
        g_sigma.append(sum(gamma[i, k] * ((x[i] - means[k]) ** 2 / variances[k] - 1) for i in range(n))
                       / (n * np.sqrt(2 * weights[k])))
    expected = np.concatenate(g_mu + g_sigma)
    expected = np.sign(expected) * np.sqrt(np.abs(expected))
    expected /= np.linalg.norm(expected)
    # Two sentences: the three words, and the first word alone.
    words = np.concatenate([x, x[:1]])
    got = fisher_vectors(words, np.array([0, 0, 0, 1]), 2, "gmm", weights, means, variances)
    np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-6)
    unnormalised = fisher_vectors(x, np.zeros(3, int), 1, "gmm", weights, means, variances, normalize=False)
    np.testing.assert_allclose(unnormalised[0], np.concatenate(g_mu + g_sigma), rtol=1e-5, atol=1e-7)


def test_laplacian_fisher_vector_matches_hand_computation():
    weights = np.array([0.4, 0.6])
    means = np.array([[0.0], [3.0]])
    scales = np.array([[1.0], [0.5]])
    x = np.array([[0.5], [2.0], [3.5]])
    lik = np.array([[w * np.exp(-abs(xi[0] - m[0]) / b[0]) / (2 * b[0]) for w, m, b in zip(weights, means, scales)]
                    for xi in x])
    gamma = lik / lik.sum(axis=1, keepdims=True)
    g_mu = [sum(gamma[i, k] * np.sign(x[i, 0] - means[k, 0]) for i in range(3)) / (3 * np.sqrt(weights[k]))
            for k in range(2)]
    g_b = [sum(gamma[i, k] * (abs(x[i, 0] - means[k, 0]) / scales[k, 0] - 1) for i in range(3))
           / (3 * np.sqrt(weights[k])) for k in range(2)]
    got = fisher_vectors(x, np.zeros(3, int), 1, "hglmm", weights, means, scales, normalize=False)
    np.testing.assert_allclose(got[0], g_mu + g_b, rtol=1e-5, atol=1e-7)


def test_hglmm_em_increases_log_likelihood():
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0, 0.0], [5.0, 5.0, -5.0], [-5.0, 4.0, 3.0]])
    x = np.concatenate([rng.laplace(c, [1.0, 0.5, 2.0], size=(300, 3)) for c in centres])
    weights, means, scales, history = fit_hglmm(x, 3, max_iter=20, seed=0)
    assert len(history) >= 2
    assert history[-1] > history[0]
    assert all(b >= a - 1e-6 for a, b in zip(history, history[1:]))  # monotone in practice
    np.testing.assert_allclose(np.sort(weights), [1 / 3] * 3, atol=0.02)
    recovered = means[np.argsort(means[:, 0])]
    np.testing.assert_allclose(recovered, centres[np.argsort(centres[:, 0])], atol=0.3)
    assert scales.shape == (3, 3) and np.all(scales > 0)


def test_fisher_pca(word_vectors, sentences):
    encoder = FisherVectorEncoder(word_vectors, num_components=2, mixture="gmm", pca_dim=4, seed=0)
    out = encoder.fit(sentences).transform(sentences)
    assert out.shape == (len(sentences), 4)
    with pytest.raises(ConfigError, match="pca_dim"):
        FisherVectorEncoder(word_vectors, num_components=2, pca_dim=500).fit(sentences)


@pytest.mark.parametrize("name", ["tfidf", "mean_vector", "fisher_gmm", "fisher_hglmm"])
def test_save_load_round_trip(tmp_path, word_vectors, sentences, name):
    kwargs = {} if name == "tfidf" else {"word_vectors": word_vectors}
    if name.startswith("fisher"):
        kwargs.update(num_components=2, pca_dim=3)
    encoder = build_text_encoder(name, **kwargs).fit(sentences)
    path = tmp_path / f"{name}.npz"
    encoder.save(path)
    loaded = load_text_encoder(path)
    assert type(loaded) is type(encoder)
    assert loaded.get_config() == encoder.get_config()
    np.testing.assert_array_equal(loaded.transform(sentences), encoder.transform(sentences))


def test_registry_and_load_errors(tmp_path, word_vectors):
    with pytest.raises(ConfigError, match="unknown text encoder"):
        build_text_encoder("bert")
    with pytest.raises(ConfigError, match="needs word_vectors"):
        build_text_encoder("fisher_hglmm")
    with pytest.raises(ConfigError, match="bad arguments"):
        build_text_encoder("tfidf", bogus=1)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(DataFormatError, match="bad.npz"):
        load_text_encoder(bad)
    saved = tmp_path / "mean.npz"
    MeanWordVectorEncoder(word_vectors).save(saved)
    with pytest.raises(DataFormatError, match="expected 'tfidf'"):
        TfidfEncoder.load(saved)


def test_tfidf_on_real_captions(realdata):
    from tf_twobranch.data.formats.flickr30k_tokens import read_token_file
    from tf_twobranch.data.tokenize import tokenize_caption

    corpus = read_token_file(realdata / "flickr30k" / "captions_multi30k.token")
    tokens = [tokenize_caption(c) for c in corpus.captions[:2000]]
    encoder = TfidfEncoder(max_features=3000).fit(tokens)
    assert 1000 < encoder.output_dim <= 3000
    assert "the" not in encoder.vocabulary and "dog" in encoder.vocabulary
    out = encoder.transform(tokens[:200])
    assert out.shape == (200, encoder.output_dim)
    norms = np.linalg.norm(out, axis=1)
    assert np.all((np.abs(norms - 1) < 1e-5) | (norms == 0))
    # Captions of the same image share words: cosine with a sibling beats a random caption.
    same = np.mean([out[i] @ out[i + 1] for i in range(0, 200, 5)])
    other = np.mean([out[i] @ out[(i + 57) % 200] for i in range(0, 200, 5)])
    assert same > 2 * other


def _run_module(module, *args):
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[3]
    return run_python(["-m", module, *args], cwd=repo,
                      timeout=120)


def test_extract_text_features_cli(tmp_path):
    from tf_twobranch.data.formats.features import load_feature_matrix

    captions = tmp_path / "captions.token"
    lines = []
    for image in range(6):
        for k in range(2):
            lines.append(f"{100 + image}.jpg#{k}\tA dog number {image} runs on the red road {k} times.")
    captions.write_text("\n".join(lines) + "\n")
    (tmp_path / "train.txt").write_text("100\n101\n102\n103\n999\n")
    (tmp_path / "test.txt").write_text("104\n105\n")
    out_dir = tmp_path / "out"
    result = _run_module("tf_twobranch.tools.extract_text_features", f"--captions={captions}",
                         f"--train_split={tmp_path / 'train.txt'}", f"--splits={tmp_path / 'test.txt'}",
                         "--encoder=tfidf", f"--out_dir={out_dir}")
    assert result.returncode == 0, result.stderr
    features = load_feature_matrix(out_dir / "test_text_features.h5", "text_features", layout="columns")
    assert features.shape[0] == 4
    assert load_feature_matrix(out_dir / "train_text_features.h5", layout="columns").shape[0] == 8
    assert (out_dir / "test_captions.tsv").read_text().splitlines()[0].startswith("104\t")
    reloaded = load_text_encoder(out_dir / "text_encoder.npz")
    assert reloaded.output_dim == features.shape[1]

    bad = _run_module("tf_twobranch.tools.extract_text_features", f"--captions={captions}",
                      f"--train_split={tmp_path / 'train.txt'}", "--encoder=bert", f"--out_dir={out_dir}")
    assert bad.returncode != 0
    assert "unknown; choose one of" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------- memory (issue 39, item 10)

def _traced_peak(fn):
    import tracemalloc
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _many_words(count=400, dim=50, seed=0):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(count)]
    return words, WordVectors(words, rng.standard_normal((count, dim)).astype(np.float32))


def _random_words_and_gmm(*, seed, k, d, sentences, words):
    """`words` random word vectors owned by sorted random sentences, and a random k-component
    mixture (uniform weights, means, scales) to encode them with."""
    rng = np.random.default_rng(seed)
    weights = np.full(k, 1.0 / k)
    means, scales = rng.standard_normal((k, d)), rng.random((k, d)) + 0.5
    x = rng.standard_normal((words, d))
    owner = np.sort(rng.integers(0, sentences, words))
    return x, owner, (weights, means, scales)


def test_fisher_vector_batch_is_normalised_in_place():
    # The float64 FVs of a batch (2000 x 18000 = 288 MB at paper size) were copied four times by
    # the power and L2 normalisation (peak ~5x the batch); in place it is the batch, its mask and
    # the float32 result.
    k, d, sentences = 8, 50, 500
    x, owner, gmm = _random_words_and_gmm(seed=3, k=k, d=d, sentences=sentences, words=5000)
    batch_bytes = sentences * 2 * k * d * 8
    peak = _traced_peak(lambda: fisher_vectors(x, owner, sentences, "hglmm", *gmm))
    assert peak < 3.0 * batch_bytes, f"peak {peak / batch_bytes:.2f}x the float64 batch"


def test_fisher_vector_normalisation_keeps_its_values():
    sentences = 40
    x, owner, gmm = _random_words_and_gmm(seed=4, k=3, d=6, sentences=sentences, words=300)
    owner[owner == 5] = 6                                     # sentence 5 has no words
    raw = fisher_vectors(x, owner, sentences, "hglmm", *gmm, normalize=False).astype(np.float64)
    expected = np.sign(raw) * np.sqrt(np.abs(raw))
    norms = np.linalg.norm(expected, axis=1, keepdims=True)
    expected = np.divide(expected, norms, out=np.zeros_like(expected), where=norms > 0)
    got = fisher_vectors(x, owner, sentences, "hglmm", *gmm)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert not got[5].any()


def test_pca_of_fisher_vectors_centres_its_sample_in_place():
    # sklearn's PCA copied the (pca_max_sentences x fv_dim) sample to centre it: 2 x 1.44 GB at
    # the papers' 20,000 x 18000. The sample is the fit's one large array now.
    words, vectors = _many_words()
    rng = np.random.default_rng(5)
    sentences = [[words[j] for j in rng.integers(0, len(words), 10)] for _ in range(3000)]
    encoder = FisherVectorEncoder(vectors, num_components=8, pca_dim=100, max_iter=3, batch_size=500)
    sample_bytes = 3000 * encoder.fv_dim * 4
    peak = _traced_peak(lambda: encoder.fit(sentences))
    assert peak < 2.6 * sample_bytes, f"fit peak {peak / sample_bytes:.2f}x the PCA sample"
