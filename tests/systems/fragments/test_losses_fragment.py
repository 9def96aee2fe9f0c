"""Fragment objectives (Karpathy et al. 2014, eqs. 4-7) against plain loops in numpy."""
import numpy as np
import pytest

from tf_twobranch.systems.fragments import losses as fl

B, M, F, H = 4, 3, 5, 6


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(B, M, H)).astype(np.float32)
    s = rng.normal(size=(B, F, H)).astype(np.float32)
    vm = np.ones((B, M), bool)
    vm[1, 2] = False                    # an image with 2 fragments
    sm = rng.random((B, F)) < 0.7
    sm[:, 0] = True
    sm[2] = False                       # a sentence with no fragment left
    return v, s, vm, sm


def _fragments(v, s, vm, sm):
    """Flat lists: (image index, vector) and (sentence index, vector) of valid fragments."""
    images = [(k, v[k, m]) for k in range(B) for m in range(M) if vm[k, m]]
    sentences = [(l, s[l, f]) for l in range(B) for f in range(F) if sm[l, f]]
    return images, sentences


def _numpy_labels(v, s, vm, sm, mil):
    images, sentences = _fragments(v, s, vm, sm)
    y = np.array([[1.0 if k == l else -1.0 for (l, _) in sentences] for (k, _) in images])
    if mil:
        for j, (l, sv) in enumerate(sentences):
            bag = [i for i, (k, _) in enumerate(images) if k == l]
            scores = [float(images[i][1] @ sv) for i in bag]
            for i, sc in zip(bag, scores):
                y[i, j] = 1.0 if sc > 0 else -1.0
            if bag and not any(sc > 0 for sc in scores):
                y[bag[int(np.argmax(scores))], j] = 1.0
    return images, sentences, y


def _to_flat(tensor, vm, sm):
    """(B, M, B, F) -> (valid image fragments, valid sentence fragments) in the flat order."""
    t = np.asarray(tensor)
    rows = [(k, m) for k in range(B) for m in range(M) if vm[k, m]]
    cols = [(l, f) for l in range(B) for f in range(F) if sm[l, f]]
    return np.array([[t[k, m, l, f] for (l, f) in cols] for (k, m) in rows])


@pytest.mark.parametrize("mil", [False, True])
def test_labels_match_the_numpy_heuristic(mil):
    v, s, vm, sm = _inputs(1)
    images, sentences, want = _numpy_labels(v, s, vm, sm, mil)
    scores = fl.fragment_scores(v, s)
    got = _to_flat(fl.fragment_alignment_labels(scores, vm, sm, mil=mil), vm, sm)
    np.testing.assert_array_equal(got, want)
    if mil:   # every positive bag keeps at least one positive, the forced one is the arg-max
        for j, (l, _) in enumerate(sentences):
            bag = [i for i, (k, _) in enumerate(images) if k == l]
            assert (got[bag, j] > 0).any()


def test_forced_positive_is_the_best_scoring_fragment_of_the_bag():
    v, s, vm, sm = _inputs(2)
    s = -np.abs(s)
    v = np.abs(v)               # every score negative: every bag needs its forced positive
    scores = np.asarray(fl.fragment_scores(v, s))
    labels = np.asarray(fl.fragment_alignment_labels(scores, vm, sm, mil=True))
    for l in range(B):
        for f in range(F):
            if not sm[l, f]:
                continue
            bag = np.where(vm[l], scores[l, :, l, f], -np.inf)
            assert labels[l, :, l, f].tolist().count(1.0) == 1
            assert labels[l, int(np.argmax(bag)), l, f] == 1.0


@pytest.mark.parametrize("mil,balanced", [(False, False), (True, False), (False, True), (True, True)])
def test_fragment_alignment_objective_matches_numpy(mil, balanced):
    v, s, vm, sm = _inputs(3)
    images, sentences, y = _numpy_labels(v, s, vm, sm, mil)
    dots = np.array([[iv @ sv for (_, sv) in sentences] for (_, iv) in images], np.float64)
    hinge = np.maximum(0.0, 1.0 - y * dots)
    if balanced:
        w = np.zeros_like(hinge)
        for j in range(len(sentences)):
            pos, neg = y[:, j] > 0, y[:, j] < 0
            w[pos, j] = 1.0 / pos.sum()
            w[neg, j] = 1.0 / neg.sum()
        want = (w * hinge).sum()
    else:
        want = hinge.sum()
    scores = fl.fragment_scores(v, s)
    labels = fl.fragment_alignment_labels(scores, vm, sm, mil=mil)
    got = float(fl.fragment_alignment_objective(scores, labels, vm, sm, class_balanced=balanced))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("normaliser,n", [("paper", 5.0), ("code", 10.0)])
def test_global_scores_match_the_double_sum(normaliser, n):
    v, s, vm, sm = _inputs(4)
    want = np.zeros((B, B))
    for k in range(B):
        for l in range(B):
            total = sum(max(0.0, float(v[k, m] @ s[l, f]))
                        for m in range(M) if vm[k, m] for f in range(F) if sm[l, f])
            denominator = sm[l].sum() + n
            if normaliser == "paper":
                denominator *= vm[k].sum()
            want[k, l] = total / denominator
    got = np.asarray(fl.global_scores(v, vm, s, sm, smoothing=n, normaliser=normaliser))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert np.all(got[:, 2] == 0.0)     # no fragment: 0 with every image


def test_global_ranking_objective_matches_numpy():
    rng = np.random.default_rng(5)
    S = rng.normal(size=(6, 6)).astype(np.float32)
    margin = 0.3
    want = 0.0
    for k in range(6):
        for l in range(6):
            if l != k:
                want += max(0.0, S[k, l] - S[k, k] + margin) + max(0.0, S[l, k] - S[k, k] + margin)
    np.testing.assert_allclose(float(fl.global_ranking_objective(S, margin=margin)), want, rtol=1e-5)


def test_unknown_normaliser_is_refused():
    v, s, vm, sm = _inputs(0)
    with pytest.raises(ValueError, match="normaliser"):
        fl.global_scores(v, vm, s, sm, normaliser="mean")
