"""Tests of the normalised CCA baseline (tf_twobranch.systems.two_branch.cca)."""
import numpy as np
import pytest
import scipy.linalg

from tf_twobranch.systems.two_branch.cca import CCABaseline
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError


def _latent_pairs(n, dx, dy, dz=3, noise=0.5, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, dz))
    x = z @ rng.standard_normal((dz, dx)) + noise * rng.standard_normal((n, dx))
    y = z @ rng.standard_normal((dz, dy)) + noise * rng.standard_normal((n, dy))
    return x, y


def _reference_correlations(x, y, reg):
    """Top canonical correlations from the joint generalised eigenproblem."""
    n = len(x)
    xc, yc = x - x.mean(0), y - y.mean(0)
    cxx, cyy, cxy = xc.T @ xc / n, yc.T @ yc / n, xc.T @ yc / n
    cxx = cxx + reg * np.trace(cxx) / cxx.shape[0] * np.eye(cxx.shape[0])
    cyy = cyy + reg * np.trace(cyy) / cyy.shape[0] * np.eye(cyy.shape[0])
    dx = cxx.shape[0]
    a = np.zeros((dx + cyy.shape[0],) * 2)
    a[:dx, dx:], a[dx:, :dx] = cxy, cxy.T
    b = scipy.linalg.block_diag(cxx, cyy)
    return scipy.linalg.eigh(a, b, eigvals_only=True)[::-1]


def test_closed_form_matches_sklearn_nipals():
    x, y = _latent_pairs(300, 8, 10)
    closed = CCABaseline(n_components=5, reg=1e-8).fit(x, y)
    nipals = CCABaseline(n_components=5, solver="sklearn").fit(x, y)
    np.testing.assert_allclose(closed.canonical_correlations_[:3],
                               nipals.canonical_correlations_[:3], atol=1e-2)
    assert closed.canonical_correlations_[0] > 0.9
    # Same subspaces: the leading embeddings agree up to the sign of each axis.
    e_closed, e_nipals = closed.transform_images(x)[:, :3], nipals.transform_images(x)[:, :3]
    cos = np.abs(np.sum(e_closed * e_nipals, 0)) / np.sqrt(
        np.sum(e_closed ** 2, 0) * np.sum(e_nipals ** 2, 0))
    assert np.all(cos > 0.95)


@pytest.mark.parametrize("n,dx,dy,max_dim", [
    (200, 6, 9, None),     # covariance (Cholesky) form for both views
    (30, 12, 45, None),    # dual (Gram) form for the text view
    (20, 40, 50, None),    # dual form for both views
])
def test_closed_form_solves_the_regularised_eigenproblem(n, dx, dy, max_dim):
    x, y = _latent_pairs(n, dx, dy, seed=n)
    reg = 1e-2
    model = CCABaseline(n_components=4, reg=reg, max_dim=max_dim).fit(x, y)
    np.testing.assert_allclose(model.canonical_correlations_,
                               _reference_correlations(x, y, reg)[:4], rtol=1e-6, atol=1e-8)
    # Constraints: canonical variates have unit (ridge-augmented) variance and
    # are cross-correlated only pairwise.
    xc, yc = x - x.mean(0), y - y.mean(0)
    px, py = xc @ model.image_projection_, yc @ model.text_projection_
    cxx = xc.T @ xc / n
    cxx += reg * np.trace(cxx) / dx * np.eye(dx)
    wx = model.image_projection_
    np.testing.assert_allclose(wx.T @ cxx @ wx, np.eye(4), atol=1e-6)
    np.testing.assert_allclose(px.T @ py / n, np.diag(model.canonical_correlations_),
                               atol=1e-6)


def test_max_dim_pca_and_component_clipping():
    x, y = _latent_pairs(100, 10, 60, seed=3)
    model = CCABaseline(n_components=50, max_dim=8, seed=1).fit(x, y)
    assert model.n_components_ == 8  # at most min(Dx, reduced Dy)
    assert model.text_projection_.shape == (60, 8)
    assert model.canonical_correlations_[0] > 0.9
    again = CCABaseline(n_components=50, max_dim=8, seed=1).fit(x, y)
    np.testing.assert_array_equal(model.canonical_correlations_, again.canonical_correlations_)


def test_float32_matches_float64():
    x, y = _latent_pairs(300, 8, 10, seed=5)
    m64 = CCABaseline(n_components=4).fit(x, y)
    m32 = CCABaseline(n_components=4).fit(x.astype(np.float32), y.astype(np.float32))
    np.testing.assert_allclose(m32.canonical_correlations_, m64.canonical_correlations_,
                               atol=1e-4)
    e = m32.transform_texts(y.astype(np.float32))
    assert e.dtype == np.float32 and e.shape == (300, 4)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)


def test_retrieval_far_above_chance():
    from tf_twobranch.evaluation.retrieval import retrieval_metrics
    rng = np.random.default_rng(7)
    dz, dx, dy, per_image = 16, 32, 48, 5
    a, b = rng.standard_normal((dz, dx)), rng.standard_normal((dz, dy))

    def split(num_images):
        z_img = rng.standard_normal((num_images, dz))
        z_cap = np.repeat(z_img, per_image, 0) + 0.3 * rng.standard_normal(
            (num_images * per_image, dz))
        images = z_img @ a + 0.5 * rng.standard_normal((num_images, dx))
        captions = z_cap @ b + 0.5 * rng.standard_normal((len(z_cap), dy))
        return images.astype(np.float32), captions.astype(np.float32)

    train_images, train_captions = split(300)
    caption_image = np.repeat(np.arange(100), per_image)
    test_images, test_captions = split(100)
    model = CCABaseline(n_components=dz).fit(np.repeat(train_images, per_image, 0),
                                            train_captions)
    metrics = retrieval_metrics(model.transform_images(test_images),
                                model.transform_texts(test_captions), caption_image)
    # Chance R@1 is 5 % (image → text) and 1 % (text → image).
    assert metrics["i2t_r1"] > 60.0, metrics
    assert metrics["t2i_r1"] > 40.0, metrics


def test_save_load_round_trip(tmp_path):
    x, y = _latent_pairs(120, 7, 9, seed=11)
    model = CCABaseline(n_components=5, reg=1e-3, eigen_power=2.0, max_dim=None).fit(x, y)
    path = tmp_path / "cca.npz"
    model.save(path)
    loaded = CCABaseline.load(path)
    assert (loaded.n_components, loaded.reg, loaded.eigen_power, loaded.solver,
            loaded.seed, loaded.max_dim) == (5, 1e-3, 2.0, "closed_form", 0, None)
    np.testing.assert_array_equal(loaded.canonical_correlations_, model.canonical_correlations_)
    np.testing.assert_array_equal(loaded.transform_images(x), model.transform_images(x))
    np.testing.assert_array_equal(loaded.transform_texts(y), model.transform_texts(y))


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(DataFormatError, match="no such"):
        CCABaseline.load(tmp_path / "absent.npz")
    junk = tmp_path / "junk.npz"
    junk.write_text("not an archive")
    with pytest.raises(DataFormatError, match="junk.npz"):
        CCABaseline.load(junk)
    partial = tmp_path / "partial.npz"
    np.savez(partial, image_mean=np.zeros(3))
    with pytest.raises(DataFormatError, match="missing arrays"):
        CCABaseline.load(partial)


def test_bad_inputs_raise_user_errors():
    x, y = _latent_pairs(50, 4, 5)
    with pytest.raises(UserInputError, match="50 image rows and 49 text rows"):
        CCABaseline().fit(x, y[:-1])
    bad = y.copy()
    bad[7, 2] = np.nan
    with pytest.raises(UserInputError, match="row 7, column 2"):
        CCABaseline().fit(x, bad)
    with pytest.raises(UserInputError, match="2-D"):
        CCABaseline().fit(x[:, 0], y)
    with pytest.raises(UserInputError, match="zero variance"):
        CCABaseline().fit(np.ones((50, 4)), y)
    with pytest.raises(UserInputError, match="not fitted"):
        CCABaseline().transform_images(x)
    model = CCABaseline(n_components=2).fit(x, y)
    with pytest.raises(UserInputError, match="fitted on 5-d"):
        model.transform_texts(x)
    with pytest.raises(ConfigError, match="solver"):
        CCABaseline(solver="nipals")
    with pytest.raises(ConfigError, match="n_components"):
        CCABaseline(n_components=0)
    with pytest.raises(ConfigError, match="reg"):
        CCABaseline(reg=-1.0)
    with pytest.raises(ConfigError, match="max_dim"):
        CCABaseline(max_dim=0)
