"""Normalised CCA baseline ("CCA (FV HGLMM)" of TPAMI Tables 1–3 (a)).

The formulation of Gong et al. (IJCV 2014), used by Klein et al. (CVPR 2015)
and Plummer et al. (ICCV 2015) on the same image and text features as the
embedding network:

1. Centre both views with the training means.
2. Regularised linear CCA in closed form: maximise aᵀ C_xy b subject to
   aᵀ (C_xx + r_x I) a = 1 and bᵀ (C_yy + r_y I) b = 1. The ridge of each view
   is relative to its covariance, ``r_x = reg · trace(C_xx) / D_x`` (``reg``
   times the mean per-dimension variance), so ``reg`` does not depend on the
   feature scale or dimension.
3. Keep the top ``k`` canonical pairs and scale both projections by the
   canonical correlations raised to ``eigen_power`` (p = 4 in Gong et al.);
   similarity is the cosine in the scaled space, so the embeddings are
   L2-normalised and dot products rank exactly like cosine similarity.

Solver. Each view is whitened once, then one small SVD gives every pair:

* ``D ≤ n`` (covariance form): Cholesky ``C + rI = L Lᵀ``; the whitened
  cross-covariance is ``M = L_x⁻¹ C_xy L_y⁻ᵀ``.
* ``D > n`` (dual / kernel form): eigen-decomposition of the ``n × n`` Gram
  matrix gives the thin SVD ``X_c = U S Vᵀ``; the optimal directions lie in
  span(V), where ``C + rI`` is diagonal, so the whitening is exact.
* ``max_dim`` (optional): a view wider than ``max_dim`` is first reduced by
  randomised PCA (seeded, 2 power iterations) to its top ``max_dim``
  principal directions, then whitened in that basis. It costs about
  ``6·n·D·max_dim`` flops, so it only beats the exact ``n·D²`` covariance when
  ``max_dim ≲ D/6`` (or saves memory when D is very large); the ridge is then
  relative to the reduced view, ``reg · trace / max_dim``.

The singular values of ``M`` are the (ridge-shrunk) canonical correlations.
The large products run in the inputs' precision (float32 features stay
float32, which halves the time); every decomposition runs in float64.

Cost at the TPAMI size (n = 12.5k pairs, 1024-d images, 6000-d FV text,
float32): ≈ 6·10¹¹ flops, dominated by the text covariance (n·6000²), then
C_xy, the 6000² Cholesky and one triangular solve; about 15 CPU-seconds
measured here, i.e. ~7 s wall on 2 idle cores (much more when the machine is
shared).

``solver="sklearn"`` wraps scikit-learn's NIPALS ``CCA`` (no ridge: ``reg``
and ``max_dim`` are ignored). It is far too slow for real features and exists
to cross-check the closed form on small problems.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import scipy.linalg
from sklearn.cross_decomposition import CCA
from sklearn.utils.extmath import randomized_svd

from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError
from tf_twobranch.training.fit_timing import reports_fit
from tf_twobranch.vectors import l2_normalize_rows

SOLVERS = ("closed_form", "sklearn")
_FORMAT = "tf_twobranch.cca.v1"
_SAVED_ARRAYS = ("image_mean", "text_mean", "image_projection", "text_projection",
                 "canonical_correlations")


@dataclasses.dataclass
class _Whitening:
    """``T`` with ``Tᵀ (C + rI) T = I`` on the subspace where the optimum lies.

    Either ``cholesky`` (``T = L⁻ᵀ``) or ``basis``/``scale`` (``T = E·diag(d)``).
    ``scores`` caches ``X_c T`` when it came for free (dual form, PCA).
    """
    cholesky: np.ndarray | None = None
    basis: np.ndarray | None = None
    scale: np.ndarray | None = None
    scores: np.ndarray | None = None

    def apply(self, coefficients: np.ndarray) -> np.ndarray:
        """``T @ coefficients``: canonical coefficients → feature-space projections."""
        if self.cholesky is not None:
            return scipy.linalg.solve_triangular(self.cholesky, coefficients, lower=True,
                                                 trans="T", check_finite=False)
        return self.basis @ (self.scale[:, None] * coefficients)

    def whitened_scores(self, centred: np.ndarray) -> np.ndarray:
        """``X_c T`` (n × r)."""
        if self.scores is not None:
            return self.scores
        if self.cholesky is not None:
            return scipy.linalg.solve_triangular(self.cholesky, centred.T, lower=True,
                                                 check_finite=False).T
        return (centred @ self.basis) * self.scale


def _compute_dtype(x: np.ndarray):
    return np.float64 if x.dtype == np.float64 else np.float32


def _as_features(x, name: str, expected_dim: int | None = None) -> np.ndarray:
    """Validates a 2-D finite numeric feature matrix."""
    try:
        arr = np.asarray(x)
    except Exception as err:  # ragged lists and the like
        raise UserInputError(f"{name} must be a 2-D numeric array (n, d): {err}") from None
    if arr.dtype.kind not in "biuf":
        raise UserInputError(f"{name} must be numeric, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise UserInputError(f"{name} must be a 2-D array (n, d), got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise UserInputError(f"{name} is empty (shape {arr.shape})")
    if expected_dim is not None and arr.shape[1] != expected_dim:
        raise UserInputError(f"{name} has {arr.shape[1]} columns, but the CCA model was "
                             f"fitted on {expected_dim}-d features")
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float32)
    finite = np.isfinite(arr)
    if not finite.all():
        row, col = np.argwhere(~finite)[0]
        raise UserInputError(f"{name} has NaN/inf values (first at row {row}, column {col})")
    return arr


def _whiten(centred: np.ndarray, reg: float, max_dim: int | None, seed: int,
            name: str) -> _Whitening:
    """Regularised whitening of one centred view (see the module docstring)."""
    n, dim = centred.shape
    if max_dim is not None and max_dim < dim:
        u, s, vt = randomized_svd(centred, max_dim, n_oversamples=10, n_iter=2,
                                  random_state=seed)
        # The ridge is relative to the reduced view (the PCA output is the CCA input).
        return _eigen_whitening(u, s.astype(np.float64), vt.T, n, max_dim, reg, name)
    if dim <= n:
        cov = (centred.T @ centred).astype(np.float64) / n
        ridge = reg * np.trace(cov) / dim
        if not np.trace(cov) > 0:
            raise UserInputError(f"{name} have zero variance: every row is the same")
        cov[np.diag_indices(dim)] += ridge
        try:
            chol = scipy.linalg.cholesky(cov, lower=True, check_finite=False)
        except np.linalg.LinAlgError:
            raise ConfigError(
                f"the covariance of {name} is singular (rank-deficient features); "
                f"use reg > 0 (got reg={reg})") from None
        return _Whitening(cholesky=chol)
    gram = (centred @ centred.T).astype(np.float64)
    eigvals, eigvecs = scipy.linalg.eigh(gram, check_finite=False, driver="evd")
    keep = eigvals > eigvals[-1] * 1e-12
    s = np.sqrt(eigvals[keep])
    u = eigvecs[:, keep]
    v = (centred.T.astype(np.float64) @ u) / s
    return _eigen_whitening(u, s, v, n, dim, reg, name)


def _eigen_whitening(u, s, v, n, dim, reg, name) -> _Whitening:
    """Whitening from a thin SVD ``X_c ≈ U S Vᵀ``; ``dim`` is the view's dimension."""
    variances = s ** 2 / n
    if not variances.sum() > 0:
        raise UserInputError(f"{name} have zero variance: every row is the same")
    keep = variances > 0
    u, s, v, variances = u[:, keep], s[keep], v[:, keep], variances[keep]
    ridge = reg * variances.sum() / dim
    scale = 1.0 / np.sqrt(variances + ridge)
    # X_c V = U S, so the whitened scores come for free.
    return _Whitening(basis=v.astype(np.float64), scale=scale,
                      scores=u.astype(np.float64) * (s * scale))


def _top_singular_pairs(m: np.ndarray, k: int):
    """Top-k singular triplets of ``m`` via the eigen-decomposition of the smaller Gram.

    Much faster than a full SVD of a wide matrix (1024 × 6000 here); squaring
    only affects the accuracy of tiny singular values, which are scaled away
    by ``eigen_power``.
    """
    transpose = m.shape[0] > m.shape[1]
    if transpose:
        m = m.T
    # Divide and conquer ("evd") is the fastest LAPACK driver here for all pairs.
    eigvals, left = scipy.linalg.eigh(m @ m.T, check_finite=False, driver="evd")
    order = np.argsort(eigvals)[::-1][:k]
    sigma = np.sqrt(np.clip(eigvals[order], 0.0, None))
    left = left[:, order]
    right = (m.T @ left) / np.where(sigma > 0, sigma, 1.0)
    return (right, sigma, left) if transpose else (left, sigma, right)


class CCABaseline:
    """Normalised CCA image–text embedding (Gong et al. 2014; Klein et al. 2015).

    Args:
      n_components: embedding size k (clipped to the number of canonical pairs
        with non-zero correlation, at most min(D_x, D_y, n − 1)); the fitted
        size is ``n_components_``.
      reg: ridge relative to each view's mean variance,
        ``r = reg · trace(C) / D``; must be ≥ 0.
      eigen_power: projections are scaled by ``canonical_correlation ** p``.
      solver: "closed_form" (default) or "sklearn" (NIPALS, small problems only).
      seed: seeds the randomised PCA of ``max_dim``.
      max_dim: optional; views wider than this are reduced by PCA first.
    """

    def __init__(self, n_components: int = 512, reg: float = 1e-4, eigen_power: float = 4.0,
                 solver: str = "closed_form", seed: int = 0, max_dim: int | None = None):
        if isinstance(n_components, bool) or not isinstance(n_components, (int, np.integer)) \
                or n_components < 1:
            raise ConfigError(f"n_components must be a positive integer, got {n_components!r}")
        if not (isinstance(reg, (int, float, np.number)) and np.isfinite(reg) and reg >= 0):
            raise ConfigError(f"reg must be a finite number ≥ 0, got {reg!r}")
        if not (isinstance(eigen_power, (int, float, np.number)) and np.isfinite(eigen_power)
                and eigen_power >= 0):
            raise ConfigError(f"eigen_power must be a finite number ≥ 0, got {eigen_power!r}")
        if solver not in SOLVERS:
            raise ConfigError(f"unknown CCA solver {solver!r}; expected one of {SOLVERS}")
        if max_dim is not None and (isinstance(max_dim, bool) or
                                    not isinstance(max_dim, (int, np.integer)) or max_dim < 1):
            raise ConfigError(f"max_dim must be None or a positive integer, got {max_dim!r}")
        self.n_components = int(n_components)
        self.reg = float(reg)
        self.eigen_power = float(eigen_power)
        self.solver = solver
        self.seed = int(seed)
        self.max_dim = None if max_dim is None else int(max_dim)
        self.image_mean_: np.ndarray | None = None
        self.text_mean_: np.ndarray | None = None
        self.image_projection_: np.ndarray | None = None  # (D_x, k), unscaled canonical
        self.text_projection_: np.ndarray | None = None   # (D_y, k)
        self.canonical_correlations_: np.ndarray | None = None  # (k,), descending

    # ------------------------------------------------------------------ fit
    @reports_fit(lambda cca: int(sum(np.asarray(getattr(cca, name)).size for name in (
        "image_mean_", "text_mean_", "image_projection_", "text_projection_"))))
    def fit(self, image_features: np.ndarray, text_features: np.ndarray) -> "CCABaseline":
        """Fits CCA on paired rows (each caption with its image's features repeated).

        Args:
          image_features: (n, D_x) image features.
          text_features: (n, D_y) text features; row i describes the image of row i.

        Returns:
          self.
        """
        x = _as_features(image_features, "image_features")
        y = _as_features(text_features, "text_features")
        if x.shape[0] != y.shape[0]:
            raise UserInputError(
                f"image_features and text_features must be paired row by row, got "
                f"{x.shape[0]} image rows and {y.shape[0]} text rows")
        n = x.shape[0]
        if n < 2:
            raise UserInputError(f"CCA needs at least 2 paired rows, got {n}")
        dtype = np.float64 if np.float64 in (x.dtype, y.dtype) else np.float32
        x_mean = x.mean(axis=0, dtype=np.float64)
        y_mean = y.mean(axis=0, dtype=np.float64)
        xc = x.astype(dtype, copy=False) - x_mean.astype(dtype)
        yc = y.astype(dtype, copy=False) - y_mean.astype(dtype)
        if self.solver == "sklearn":
            wx, wy, rho = self._fit_sklearn(xc, yc)
        else:
            wx, wy, rho = self._fit_closed_form(xc, yc)
        self.image_mean_ = x_mean
        self.text_mean_ = y_mean
        self.image_projection_ = wx
        self.text_projection_ = wy
        self.canonical_correlations_ = rho
        return self

    def _fit_closed_form(self, xc, yc):
        n = xc.shape[0]
        wh_x = _whiten(xc, self.reg, self.max_dim, self.seed, "image_features")
        wh_y = _whiten(yc, self.reg, self.max_dim, self.seed, "text_features")
        if wh_x.cholesky is not None and wh_y.cholesky is not None:
            # Covariance form: C_xy costs n·D_x·D_y, far less than whitening the
            # rows of the wide view (n·D_y²).
            cross = (xc.T @ yc).astype(np.float64) / n
            left = scipy.linalg.solve_triangular(wh_x.cholesky, cross, lower=True,
                                                 check_finite=False)
            m = scipy.linalg.solve_triangular(wh_y.cholesky, left.T, lower=True,
                                              check_finite=False).T
        else:
            zx = wh_x.whitened_scores(xc)
            zy = wh_y.whitened_scores(yc)
            m = (zx.T @ zy) / n
        k = min(self.n_components, *m.shape, n - 1)
        p, sigma, q = _top_singular_pairs(m, k)
        nonzero = sigma > sigma[0] * 1e-10
        if not nonzero.any():
            raise UserInputError("image_features and text_features are uncorrelated: "
                                 "every canonical correlation is 0")
        p, sigma, q = p[:, nonzero], sigma[nonzero], q[:, nonzero]
        return wh_x.apply(p), wh_y.apply(q), sigma

    def _fit_sklearn(self, xc, yc):
        n = xc.shape[0]
        k = min(self.n_components, xc.shape[1], yc.shape[1], n - 1)
        model = CCA(n_components=k, scale=False, max_iter=1000, tol=1e-10)
        model.fit(xc.astype(np.float64), yc.astype(np.float64))
        xs = xc.astype(np.float64) @ model.x_rotations_
        ys = yc.astype(np.float64) @ model.y_rotations_
        xs_std, ys_std = xs.std(axis=0), ys.std(axis=0)
        ok = (xs_std > 0) & (ys_std > 0)
        rho = (xs[:, ok] * ys[:, ok]).mean(axis=0) / (xs_std[ok] * ys_std[ok])
        wx = model.x_rotations_[:, ok] / xs_std[ok]
        wy = model.y_rotations_[:, ok] / ys_std[ok]
        sign = np.where(rho < 0, -1.0, 1.0)  # keep correlations positive
        rho, wy = rho * sign, wy * sign
        order = np.argsort(rho)[::-1]
        return wx[:, order], wy[:, order], rho[order]

    # ------------------------------------------------------------ transform
    @property
    def n_components_(self) -> int:
        """The fitted embedding size."""
        self._check_fitted()
        return int(self.canonical_correlations_.shape[0])

    def _check_fitted(self):
        if self.canonical_correlations_ is None:
            raise UserInputError("the CCA model is not fitted: call fit() or load() first")

    def _embed(self, features, mean, projection, name) -> np.ndarray:
        self._check_fitted()
        arr = _as_features(features, name, expected_dim=projection.shape[0])
        dtype = _compute_dtype(arr)
        weights = projection * (self.canonical_correlations_ ** self.eigen_power)
        out = (arr - mean.astype(dtype)) @ weights.astype(dtype)
        return l2_normalize_rows(out, dtype=None).astype(np.float32)

    def transform_images(self, x: np.ndarray) -> np.ndarray:
        """L2-normalised, correlation-scaled projections (n, k) of image features (float32)."""
        return self._embed(x, self.image_mean_, self.image_projection_, "image features")

    def transform_texts(self, y: np.ndarray) -> np.ndarray:
        """L2-normalised, correlation-scaled projections (n, k) of text features (float32)."""
        return self._embed(y, self.text_mean_, self.text_projection_, "text features")

    # ---------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike) -> None:
        """Writes the fitted model to an ``.npz`` file (no pickles)."""
        self._check_fitted()
        np.savez(
            path, format=np.array(_FORMAT),
            n_components=np.array(self.n_components), reg=np.array(self.reg),
            eigen_power=np.array(self.eigen_power), solver=np.array(self.solver),
            seed=np.array(self.seed), max_dim=np.array(-1 if self.max_dim is None
                                                       else self.max_dim),
            image_mean=self.image_mean_, text_mean=self.text_mean_,
            image_projection=self.image_projection_, text_projection=self.text_projection_,
            canonical_correlations=self.canonical_correlations_)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CCABaseline":
        """Reads a model written by ``save``; format problems raise DataFormatError."""
        path = pathlib.Path(path)
        try:
            archive = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise DataFormatError(path, "no such CCA model file") from None
        except Exception as err:
            raise DataFormatError(path, f"not a CCA model .npz file ({err})") from None
        with archive:
            names = set(archive.files)
            expected = {"format", "n_components", "reg", "eigen_power", "solver", "seed",
                        "max_dim", *_SAVED_ARRAYS}
            missing = sorted(expected - names)
            if missing:
                raise DataFormatError(path, f"not a CCA model file: missing arrays {missing}")
            if str(archive["format"]) != _FORMAT:
                raise DataFormatError(path, f"unknown CCA model format {str(archive['format'])!r}, "
                                            f"expected {_FORMAT!r}")
            max_dim = int(archive["max_dim"])
            try:
                model = cls(n_components=int(archive["n_components"]), reg=float(archive["reg"]),
                            eigen_power=float(archive["eigen_power"]),
                            solver=str(archive["solver"]), seed=int(archive["seed"]),
                            max_dim=None if max_dim < 0 else max_dim)
            except ConfigError as err:
                raise DataFormatError(path, f"bad hyper-parameters: {err}") from None
            arrays = {name: np.asarray(archive[name], dtype=np.float64) for name in _SAVED_ARRAYS}
        k = arrays["canonical_correlations"].shape
        shapes_ok = (len(k) == 1 and arrays["image_mean"].ndim == 1
                     and arrays["text_mean"].ndim == 1
                     and arrays["image_projection"].shape == (arrays["image_mean"].shape[0], k[0])
                     and arrays["text_projection"].shape == (arrays["text_mean"].shape[0], k[0]))
        if not shapes_ok:
            raise DataFormatError(path, "inconsistent array shapes: expected image_mean (Dx,), "
                                        "text_mean (Dy,), image_projection (Dx, k), "
                                        "text_projection (Dy, k), canonical_correlations (k,)")
        model.image_mean_ = arrays["image_mean"]
        model.text_mean_ = arrays["text_mean"]
        model.image_projection_ = arrays["image_projection"]
        model.text_projection_ = arrays["text_projection"]
        model.canonical_correlations_ = arrays["canonical_correlations"]
        return model
