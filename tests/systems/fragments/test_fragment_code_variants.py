"""The authors' DeFrag code's variants (issue 23 items 13-16) against plain numpy transcriptions.

`_defrag_cost` and `_defrag_eval_scores` transcribe the formulas of
`matlab_code/DeFragCost.m` and `DeFragEval.m` (bbugs/DeepFashion) loop for
loop: fragments as flat lists with their image / sentence index (imgVecI,
sentVecI), MATLAB's sign(0) = 0 and its "+2 on the arg-max" forcing, W only
on Y == ±1, S_G accumulated with `thrglobalscore` and `maxaccum`, and
cost = lcost + gscale·gcost + regC/2·Σθ².
"""
import types

import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.systems.fragments.retrieval import fragment_score_fn
from tf_twobranch.systems.fragments import losses as fl
from tf_twobranch.systems.fragments.model import FragmentEmbeddingConfig, build_fragment_model

# global_score -> the code's (thrglobalscore, maxaccum)
CODE_SWITCHES = {"sum_relu": (True, False), "sum": (False, False), "max_relu": (True, True), "max": (False, True)}


def _defrag_cost(dots, img_i, sent_i, *, domil, lmargin=1.0, lscale=1.0, gmargin, gscale,
                 thrglobalscore, maxaccum, smoothnum, uselocal=True, useglobal=True):
    """(lcost, gcost) of DeFragCost.m from the fragment scores `dots` (Ni, Ns)."""
    n = int(max(img_i.max(), sent_i.max())) + 1
    ni, ns = dots.shape
    cost_local = cost_global = 0.0
    if uselocal:
        meq = img_i[:, None] == sent_i[None, :]
        y = np.where(meq, 1.0, -1.0)
        if domil:
            fpos = dots * meq - 9999 * (~meq)
            ypos = np.sign(fpos)
            for col in range(ns):
                if not np.any(ypos[:, col] == 1):
                    ypos[int(np.argmax(fpos[:, col])), col] += 2     # MATLAB max: first of ties
            y[meq] = ypos[meq]
        marg = np.maximum(0.0, lmargin - y * dots)
        w = np.zeros((ni, ns))
        for col in range(ns):
            ypos, yneg = y[:, col] == 1, y[:, col] == -1
            if ypos.any():
                w[ypos, col] = 1.0 / ypos.sum()
            if yneg.any():
                w[yneg, col] = 1.0 / yneg.sum()
        cost_local = lscale * np.sum(w * marg)
    if useglobal:
        sg = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                d = dots[np.ix_(img_i == i, sent_i == j)].copy()
                if thrglobalscore:
                    d[d < 0] = 0
                if maxaccum:
                    s = np.sum(np.max(d, axis=0)) if d.shape[1] else 0.0
                else:
                    s = np.sum(d)
                sg[i, j] = s / (d.shape[1] + smoothnum)
        for i in range(n):
            cdiff = np.maximum(0, sg[:, i] - sg[i, i] + gmargin)
            cdiff[i] = 0
            rdiff = np.maximum(0, sg[i, :] - sg[i, i] + gmargin)
            rdiff[i] = 0
            cost_global += cdiff.sum() + rdiff.sum()
        cost_global *= gscale
    return cost_local, cost_global


def _defrag_eval_scores(image_vectors, sentence_vectors, *, thrglobalscore, maxaccum, smoothnum):
    """M (Ns, Ni) of DeFragEval.m: per-image (M_k, h) and per-sentence (F_l, h) fragment lists."""
    m = np.zeros((len(sentence_vectors), len(image_vectors)))
    for i, z in enumerate(sentence_vectors):
        if len(z) == 0:
            m[i, :] = -np.inf
            continue
        for j, v in enumerate(image_vectors):
            if len(v) == 0:                   # not in the code (20 fragments always): see the caller
                continue
            d = v.astype(np.float64) @ z.astype(np.float64).T
            if thrglobalscore:
                d[d < 0] = 0
            s = np.sum(np.max(d, axis=0)) if maxaccum else np.sum(d)
            m[i, j] = s / (d.shape[1] + smoothnum)
    return m


# ----------------------------------------------------------------------------- a model with exact zeros

B, M, F, IMAGE_DIM, WORDS, WORD_DIM, H = 4, 3, 4, 6, 9, 5, 7


def _model(**overrides):
    """Word 0 has the zero vector and the biases start at 0, so a (r, 0, 0) fragment embeds to s = 0
    exactly (ReLU(0)): each of its image-fragment scores is exactly 0."""
    rng = np.random.default_rng(3)
    words = rng.normal(size=(WORDS, WORD_DIM)).astype(np.float32)
    words[0] = 0.0
    config = dict(image_dim=IMAGE_DIM, num_relations=2, vocabulary_size=WORDS, word_dim=WORD_DIM, embed_dim=H,
                  shared_relation_weights=True, normaliser="code", smoothing=10.0, class_balanced=True,
                  use_global_objective=False)
    config.update(overrides)
    model = build_fragment_model(FragmentEmbeddingConfig(**config), words)
    for w in model.trainable_weights:             # the same weights for every rule and variant
        w.assign(np.zeros(w.shape, np.float32) if "bias" in w.path
                 else rng.normal(scale=0.5, size=w.shape).astype(np.float32))
    return model


def _batch(seed=0, zero_image_fragment=False):
    rng = np.random.default_rng(seed)
    relation = rng.integers(0, 2, (B, F)).astype(np.int32)
    word1 = rng.integers(1, WORDS, (B, F)).astype(np.int32)
    word2 = rng.integers(1, WORDS, (B, F)).astype(np.int32)
    word1[0, 1] = word2[0, 1] = 0                     # all-zero sentence fragments
    word1[2, 0] = word2[2, 0] = 0
    sentence_mask = np.ones((B, F), bool)
    sentence_mask[1, 3] = False
    image_mask = np.ones((B, M), bool)
    image_mask[3, 2] = False
    images = rng.normal(size=(B, M, IMAGE_DIM)).astype(np.float32)
    if zero_image_fragment:
        images[1, 1] = 0.0                            # v = b_m = 0: exactly 0 against every s
    return {"image_fragments": images, "image_mask": image_mask, "relation": relation, "word1": word1,
            "word2": word2, "sentence_mask": sentence_mask}


def _flat_fragments(model, batch):
    """(image vectors, imgVecI, sentence vectors, sentVecI, dots) in the code's flat layout."""
    v, vm = model.embed_images(batch["image_fragments"], batch["image_mask"])
    s, sm = model.embed_sentences(batch["relation"], batch["word1"], batch["word2"], batch["sentence_mask"])
    v, vm, s, sm = (np.asarray(t) for t in (v, vm, s, sm))
    image_vectors, image_index = v[vm].astype(np.float64), np.nonzero(vm)[0]
    sentence_vectors, sentence_index = s[sm].astype(np.float64), np.nonzero(sm)[0]
    dots = image_vectors @ sentence_vectors.T
    # Signs must not hinge on float32 vs float64 rounding: every score is exactly 0 or clearly not.
    assert np.all((dots == 0) | (np.abs(dots) > 1e-4))
    return image_vectors, image_index, sentence_vectors, sentence_index, dots


def test_batch_has_the_zero_scores_the_rule_is_about():
    model = _model()
    *_, dots = _flat_fragments(model, _batch(zero_image_fragment=True))
    assert (dots == 0).all(axis=0).sum() == 2            # the two all-zero sentence fragments
    assert (dots == 0).any(axis=0).all()                  # and the zero image fragment against every one


@pytest.mark.parametrize("zero_image_fragment", [False, True])
def test_mil_fragment_objective_under_the_codes_zero_rule_matches_defragcost(zero_image_fragment):
    model = _model(mil_zero_score="ignored")
    model.mil.assign(True)
    batch = _batch(zero_image_fragment=zero_image_fragment)
    _, image_index, _, sentence_index, dots = _flat_fragments(model, batch)
    want, _ = _defrag_cost(dots, image_index, sentence_index, domil=True, gmargin=0, gscale=0,
                           thrglobalscore=True, maxaccum=False, smoothnum=10, useglobal=False)
    got = float(model.objective(batch)["fragment_objective"])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # The package's default rule (score 0 is a negative) is another number on the same batch.
    default = _model(mil_zero_score="negative")
    default.mil.assign(True)
    assert abs(float(default.objective(batch)["fragment_objective"]) - want) > 0.5


def test_default_zero_rule_adds_one_per_all_zero_sentence_fragment_with_the_same_gradients():
    batch = _batch()                                      # zeros from all-zero sentence fragments only
    results = {}
    for rule in ("negative", "ignored"):
        model = _model(mil_zero_score=rule)
        model.mil.assign(True)
        with tf.GradientTape() as tape:
            cost = model.objective(batch)["fragment_objective"]
        results[rule] = (float(cost), tape.gradient(cost, model.trainable_variables))
    # Class-balanced C_F: the forced positive (hinge 1, weight 1) and the bag's other zeros
    # (hinge 1 among the negatives) are counted by the default rule, not by the code's.
    assert results["negative"][0] == pytest.approx(results["ignored"][0] + 2, rel=1e-6)
    for a, b in zip(results["negative"][1], results["ignored"][1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_zero_rule_labels():
    scores = np.array([[0.0, -1.0, 2.0], [-0.5, 0.0, -3.0]], np.float32).reshape(1, 2, 1, 3)   # [m, f]
    image_mask, sentence_mask = np.ones((1, 2), bool), np.ones((1, 3), bool)
    ignored = fl.fragment_alignment_labels(scores, image_mask, sentence_mask, mil=True, mil_zero_score="ignored")
    negative = fl.fragment_alignment_labels(scores, image_mask, sentence_mask, mil=True)
    # Column 0: no positive, the forced best scores 0 (the code's 0 + 2: unweighted), -0.5 -> -1.
    # Column 1: the same with the best second. Column 2: a positive; -3 -> -1.
    np.testing.assert_array_equal(np.asarray(ignored)[0, :, 0], [[0, -1, 1], [-1, 0, -1]])
    np.testing.assert_array_equal(np.asarray(negative)[0, :, 0], [[1, -1, 1], [-1, 1, -1]])
    with pytest.raises(ValueError, match="mil_zero_score must be one of"):
        fl.fragment_alignment_labels(scores, image_mask, sentence_mask, mil=True, mil_zero_score="zero")


# ----------------------------------------------------------------------------- global score variants


@pytest.mark.parametrize("global_score", fl.GLOBAL_SCORES)
@pytest.mark.parametrize("mil", [False, True])
def test_whole_objective_of_each_global_score_matches_defragcost(global_score, mil):
    thr, maxaccum = CODE_SWITCHES[global_score]
    regc = 0.02
    model = _model(global_score=global_score, use_global_objective=True, global_margin=0.3, global_weight=0.5,
                   weight_decay=regc / 2, decay_biases=True, mil_zero_score="ignored")
    model.mil.assign(mil)
    rng = np.random.default_rng(7)
    for w in model.trainable_weights:                     # biases away from 0, so their decay counts
        w.assign(w.numpy() + 0.1 * rng.normal(size=w.shape).astype(np.float32))
    batch = _batch(seed=1, zero_image_fragment=True)
    _, image_index, _, sentence_index, dots = _flat_fragments(model, batch)
    local, global_ = _defrag_cost(dots, image_index, sentence_index, domil=mil, gmargin=0.3, gscale=0.5,
                                  thrglobalscore=thr, maxaccum=maxaccum, smoothnum=10)
    theta = np.concatenate([w.numpy().ravel() for w in model.trainable_weights]).astype(np.float64)
    terms = model.objective(batch)
    assert global_ > 0 and 0 < float(terms["global_objective"])      # the margin is active somewhere
    np.testing.assert_allclose(float(terms["fragment_objective"]), local, rtol=1e-6)
    np.testing.assert_allclose(0.5 * float(terms["global_objective"]), global_, rtol=1e-6)
    np.testing.assert_allclose(float(terms["loss"]), local + global_ + regc / 2 * np.sum(theta ** 2), rtol=1e-6)


def _padded(rng, num, max_len, h, empty=()):
    lengths = rng.integers(1, max_len + 1, num)
    lengths[list(empty)] = 0
    x = rng.normal(size=(num, max_len, h)).astype(np.float32)
    mask = np.arange(max_len)[None, :] < lengths[:, None]
    return x, mask


@pytest.mark.parametrize("global_score", fl.GLOBAL_SCORES)
def test_global_scores_of_each_variant_match_the_codes_accumulation(global_score):
    thr, maxaccum = CODE_SWITCHES[global_score]
    rng = np.random.default_rng(11)
    v, vm = _padded(rng, 5, 4, 6)
    s, sm = _padded(rng, 6, 5, 6, empty=[2])
    want = _defrag_eval_scores([v[k][vm[k]] for k in range(5)], [s[l][sm[l]] for l in range(6)],
                               thrglobalscore=thr, maxaccum=maxaccum, smoothnum=10.0).T
    want[:, 2] = 0.0                        # training: the code's empty sum (and empty max) is 0
    got = fl.global_scores(v, vm, s, sm, smoothing=10.0, normaliser="code", global_score=global_score)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    paper = fl.global_scores(v, vm, s, sm, smoothing=10.0, normaliser="paper", global_score=global_score)
    np.testing.assert_allclose(np.asarray(paper), want / vm.sum(axis=1)[:, None], rtol=1e-6, atol=1e-6)


def test_global_score_variants_differ_and_unknown_ones_are_refused():
    rng = np.random.default_rng(12)
    v, vm = _padded(rng, 3, 4, 5)
    s, sm = _padded(rng, 3, 4, 5)
    scores = {g: np.asarray(fl.global_scores(v, vm, s, sm, global_score=g)) for g in fl.GLOBAL_SCORES}
    for a in fl.GLOBAL_SCORES:
        for b in fl.GLOBAL_SCORES:
            assert a == b or not np.allclose(scores[a], scores[b])
    with pytest.raises(ValueError, match="global_score must be one of"):
        fl.global_scores(v, vm, s, sm, global_score="mean")
    with pytest.raises(ConfigError, match="global_score must be one of"):
        FragmentEmbeddingConfig(image_dim=2, num_relations=1, vocabulary_size=2, global_score="mean").validate()
    with pytest.raises(UserInputError, match="global_score must be one of"):
        fragment_score_fn(v, vm, s[sm], np.concatenate([[0], np.cumsum(sm.sum(1))]), global_score="mean")


@pytest.mark.parametrize("global_score", fl.GLOBAL_SCORES)
def test_deduplicated_retrieval_scorer_matches_defrageval_for_each_variant(global_score):
    """The fast path (distinct rows, image and fragment chunks) for every accumulation."""
    thr, maxaccum = CODE_SWITCHES[global_score]
    rng = np.random.default_rng(13)
    v, vm = _padded(rng, 7, 4, 6)
    vm[5] = False                                              # an image without a valid fragment
    pool = rng.normal(size=(5, 6)).astype(np.float32)          # few distinct rows: shared fragments
    lengths = np.array([2, 0, 3, 1, 4, 2, 3, 0, 2])
    sentence_fragments = pool[rng.integers(0, 5, lengths.sum())]
    splits = np.concatenate([[0], np.cumsum(lengths)])
    sentences = [sentence_fragments[splits[l]:splits[l + 1]] for l in range(len(lengths))]
    want = _defrag_eval_scores([v[k][vm[k]] for k in range(7)], sentences, thrglobalscore=thr,
                               maxaccum=maxaccum, smoothnum=10.0).T
    # Where the code differs on purpose: an empty sentence (-inf there) and an image without
    # fragments (the code always has 20) score 0 here.
    want[:, lengths == 0] = 0.0
    want[5] = 0.0
    got = fragment_score_fn(v, vm, sentence_fragments, splits, smoothing=10.0, normaliser="code",
                            global_score=global_score, fragment_chunk=2, image_chunk=3)(0, len(lengths))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    model_call = fl.global_scores(v, vm, *_to_padded(sentences, 6), smoothing=10.0, normaliser="code",
                                  global_score=global_score)
    np.testing.assert_allclose(got, np.asarray(model_call), rtol=1e-6, atol=1e-6)


def _to_padded(sentences, h):
    width = max(len(x) for x in sentences)
    s = np.zeros((len(sentences), width, h), np.float32)
    mask = np.zeros((len(sentences), width), bool)
    for l, x in enumerate(sentences):
        s[l, :len(x)], mask[l, :len(x)] = x, True
    return s, mask


# ----------------------------------------------------------------------------- biases and flags


def test_decay_biases_adds_the_biases_squared_norm():
    kernels_only, every_weight = _model(decay_biases=False), _model(decay_biases=True)
    every_weight.set_weights(kernels_only.get_weights())
    rng = np.random.default_rng(5)
    for a, b in zip(kernels_only.trainable_weights, every_weight.trainable_weights):
        value = rng.normal(size=a.shape).astype(np.float32)
        a.assign(value)
        b.assign(value)
    batch = _batch()
    bias_norm = sum(float(np.sum(w.numpy().astype(np.float64) ** 2))
                    for w in every_weight.trainable_weights if "bias" in w.path)
    assert bias_norm > 0
    gap = float(every_weight.objective(batch)["regulariser"]) - float(kernels_only.objective(batch)["regulariser"])
    np.testing.assert_allclose(gap, bias_norm, rtol=1e-5)
    assert {w.path for w in every_weight.decayed_weights} == {w.path for w in every_weight.trainable_weights}
    assert not any("bias" in w.path for w in kernels_only.decayed_weights)


def test_experiment_flags_reach_the_model_config():
    from absl import flags

    from experiments import common
    from experiments import fragments as fe
    from tf_twobranch.systems.fragments.pipeline import build_config
    f = common.parse_flagfile(fe.define_flags, "/dev/null", ["--global_score=max", "--mil_zero_score=ignored",
                                                             "--decay_biases"])
    train = types.SimpleNamespace(inputs=np.zeros((2, 3, 4), np.float32), head=None)
    text = types.SimpleNamespace(relations=["amod", "det"],
                                 word_vectors=types.SimpleNamespace(words=["a", "b", "c"], dim=5))
    config = build_config(fe.recipe_from_flags(f)[0], {"train": train}, text)
    assert (config.global_score, config.mil_zero_score, config.decay_biases) == ("max", "ignored", True)
    defaults = build_config(fe.recipe_from_flags(common.parse_flagfile(fe.define_flags, "/dev/null", []))[0],
                            {"train": train}, text)
    assert (defaults.global_score, defaults.mil_zero_score, defaults.decay_biases) == ("sum_relu", "negative",
                                                                                       False)
    assert config.score_options() == {"smoothing": 5.0, "normaliser": "paper", "global_score": "max"}
    fv = flags.FlagValues()
    fe.define_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError):
        fv(["prog", "--global_score=mean"])
