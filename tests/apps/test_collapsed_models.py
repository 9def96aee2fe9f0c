"""Evaluation never flatters: collapsed models and inputs score at or below chance.

A model that maps every image (or every caption) to one embedding — constant
or all-zero inputs, a collapsed network — ties every score. Ties count against
the query (`tf_twobranch.evaluation.retrieval`), so such a model must never
reach the recall of a random ranking, let alone a perfect table; an untrained
model on random inputs must stay within noise of chance.
"""
import json
import math

import numpy as np
import pytest

from tests.support.baselines import randomize_weights
from tests.support.forked_modules import run_python

from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

KS = retrieval.DEFAULT_KS
RECALLS = [f"{d}_r{k}" for d in ("i2t", "t2i") for k in KS]


def chance_recalls(caption_image, num_images, ks=KS, *, bound=False) -> dict:
    """R@K (percent) of a uniformly random ranking.

    t2i: one positive image among `num_images`: K / num_images.
    i2t: an image with c of the M captions: expected 1 - C(M - c, K) / C(M, K);
    with `bound`, the union bound min(1, K c / M) instead (what a ranking by
    one order shared by every query, e.g. rounding noise of a collapsed
    model, can reach at most). Averaged over the images that have captions.
    """
    caption_image = np.asarray(caption_image)
    m = len(caption_image)
    counts = np.bincount(caption_image, minlength=num_images)
    out = {}
    for k in ks:
        out[f"t2i_r{k}"] = 100.0 * min(k, num_images) / num_images
        if bound:
            hits = [min(1.0, k * c / m) for c in counts if c > 0]
        else:
            hits = [1.0 - math.comb(m - c, k) / math.comb(m, k) for c in counts if c > 0]
        out[f"i2t_r{k}"] = 100.0 * float(np.mean(hits))
    return out


def assert_at_or_below_chance(metrics, caption_image, num_images):
    """Each R@K <= chance (i2t: K c / M, t2i: K / num_images)."""
    chance = chance_recalls(caption_image, num_images, bound=True)
    for key in RECALLS:
        assert metrics[key] <= chance[key] + 1e-9, (key, metrics[key], chance[key], metrics)


def assert_worst_ranks(metrics, caption_image, num_images):
    """All scores exactly tied, ties against the query: every query ranks last.

    A caption's last place is `num_images`; an image with c of the m captions
    ranks behind all m - c others. R@K is 100 only where K reaches last place
    (e.g. t2i R@10 with 10 images), 0 otherwise.
    """
    counts = np.bincount(caption_image, minlength=num_images)
    m = len(caption_image)
    image_last = (m - counts + 1)[counts > 0]
    want = {}
    for k in KS:
        want[f"t2i_r{k}"] = 100.0 if k >= num_images else 0.0
        want[f"i2t_r{k}"] = 100.0 * float(np.mean(image_last <= k))
    for key in RECALLS:
        assert metrics[key] == pytest.approx(want[key]), (key, metrics)
    assert metrics["t2i_medr"] == num_images
    assert metrics["i2t_meanr"] == pytest.approx(float(np.mean(image_last)))
    assert metrics["rsum"] == pytest.approx(sum(want.values()))


NUM_IMAGES, CAPS = 20, 5
CAPTION_IMAGE = np.repeat(np.arange(NUM_IMAGES), CAPS)
IMAGE_DIM, TEXT_DIM = 12, 10


def _tiny(kind):
    return build_model(TwoBranchConfig(kind=kind, image_dim=IMAGE_DIM, text_dim=TEXT_DIM,
                                       image_hidden=(16,), text_hidden=(16,), embed_dim=8,
                                       similarity_head=(8,), dropout=0.0, top_k=3))


def _constant_inputs(name, rows, dim, seed):
    if name == "zeros":
        return np.zeros((rows, dim), np.float32)
    if name == "ones":
        return np.full((rows, dim), 0.5, np.float32)
    # one random row repeated: constant across items, not across features
    return np.tile(np.random.default_rng(seed).normal(size=(1, dim)), (rows, 1)).astype(np.float32)


@pytest.fixture(scope="module", params=["embedding", "similarity"])
def models(request):
    """(fresh model, model with random biases and batch-norm statistics) of one kind."""
    return _tiny(request.param), randomize_weights(_tiny(request.param))


@pytest.mark.parametrize("inputs", ["zeros", "ones", "repeated_row"])
def test_constant_inputs_score_at_or_below_chance(models, inputs):
    for model in models:
        data = {"image": _constant_inputs(inputs, NUM_IMAGES, IMAGE_DIM, 1),
                "text": _constant_inputs(inputs, len(CAPTION_IMAGE), TEXT_DIM, 2),
                "caption_image": CAPTION_IMAGE}
        images, texts = model.embed_images(data["image"]), model.embed_texts(data["text"])
        # The network maps constant inputs to one embedding per side: that is the point.
        # (Up to rounding: rows in another block of the matmul may differ in the last bit.)
        for embeds in (images, texts):
            np.testing.assert_allclose(embeds, np.broadcast_to(embeds[:1], embeds.shape),
                                       rtol=0, atol=1e-6)
            assert retrieval.is_degenerate(embeds)
        metrics = model.evaluate(data)
        assert_at_or_below_chance(metrics, CAPTION_IMAGE, NUM_IMAGES)
        if (images == images[:1]).all() and (texts == texts[:1]).all():
            assert_worst_ranks(metrics, CAPTION_IMAGE, NUM_IMAGES)  # exact ties


def test_only_one_side_collapsed_is_still_at_or_below_chance(models):
    """Constant images with informative captions (and the reverse) cannot rank by content."""
    for model in models:
        for side in ("image", "text"):
            rng = np.random.default_rng(3)
            data = {"image": rng.normal(size=(NUM_IMAGES, IMAGE_DIM)).astype(np.float32),
                    "text": rng.normal(size=(len(CAPTION_IMAGE), TEXT_DIM)).astype(np.float32),
                    "caption_image": CAPTION_IMAGE}
            data[side] = np.zeros_like(data[side])
            metrics = model.evaluate(data)
            # Every query ranks its gallery by (up to rounding) one shared order: the top K
            # hold the positives of at most K images, so R@K <= K / num_images both ways.
            assert_at_or_below_chance(metrics, CAPTION_IMAGE, NUM_IMAGES)
            collapsed = (model.embed_images(data["image"]) if side == "image"
                         else model.embed_texts(data["text"]))
            if (collapsed == collapsed[:1]).all():
                # Exactly one vector: the direction whose gallery is that side ties fully.
                tied = "t2i" if side == "image" else "i2t"
                assert all(metrics[f"{tied}_r{k}"] == 0.0 for k in KS), (side, metrics)


def _random_embedding_spread(num_images, caption_image, seeds=20):
    """Mean and standard deviation of each metric of random embeddings on this split."""
    runs = [retrieval.random_baseline_metrics(num_images, caption_image, seed=s)
            for s in range(seeds)]
    return ({k: float(np.mean([r[k] for r in runs])) for k in runs[0]},
            {k: float(np.std([r[k] for r in runs])) for k in runs[0]})


@pytest.mark.parametrize("kind", ["embedding", "similarity"])
def test_untrained_model_on_random_inputs_is_within_noise_of_chance(kind):
    num_images, caps = 50, 5
    caption_image = np.repeat(np.arange(num_images), caps)
    rng = np.random.default_rng(4)
    data = {"image": rng.normal(size=(num_images, IMAGE_DIM)).astype(np.float32),
            "text": rng.normal(size=(len(caption_image), TEXT_DIM)).astype(np.float32),
            "caption_image": caption_image}
    metrics = _tiny(kind).evaluate(data)
    chance = chance_recalls(caption_image, num_images)
    mean, std = _random_embedding_spread(num_images, caption_image)
    for key in RECALLS:
        # Random embeddings' mean matches the analytic chance level ...
        assert abs(mean[key] - chance[key]) <= 2 * std[key] + 1.0, (key, mean[key], chance[key])
        # ... and the untrained model is within noise of it, nowhere near 100.
        assert abs(metrics[key] - chance[key]) <= 4 * std[key] + 2.0, (key, metrics, chance)
    assert metrics["rsum"] <= mean["rsum"] + 4 * std["rsum"], (metrics["rsum"], mean, std)


def test_dual_path_constant_inputs_score_at_or_below_chance():
    from tf_twobranch.systems.dual_path.model import DualPathConfig, build_dual_path_model
    vocab, max_len, num_images, caps = 30, 8, 10, 2
    model = build_dual_path_model(DualPathConfig(
        vocabulary_size=vocab, num_classes=num_images, image_size=32, text_width=4,
        text_blocks=(1, 1, 1, 1), max_len=max_len, word_dim=8, hidden_dim=16, embed_dim=16,
        dropout=0.0))
    caption_image = np.repeat(np.arange(num_images), caps)
    tokens = np.zeros((len(caption_image), max_len), np.int32)
    tokens[:, :4] = [3, 7, 5, 2]  # the same caption for every image
    texts = model.embed_texts(tokens)
    for pixels in (0.0, 128.0):
        images = np.full((num_images, 32, 32, 3), pixels, np.float32)
        metrics = model.evaluate({"image": images, "text": tokens, "caption_image": caption_image})
        assert_at_or_below_chance(metrics, caption_image, num_images)
        embeds = model.embed_images(images)
        if (embeds == embeds[:1]).all() and (texts == texts[:1]).all():
            assert_worst_ranks(metrics, caption_image, num_images)  # exact ties


# --- the experiment's command line ------------------------------------------------

TINY_FLAGS = ["--epochs=1", "--batch_size=20", "--hidden_dim=16", "--embed_dim=8",
              "--top_k=3", "--export=false", "--verbose=0"]


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    from tf_twobranch.data.embedded import generate_embedded_dataset
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=120,
                                     splits=(60, 20, 40), with_proposals=False)


@pytest.mark.slow
def test_cli_with_all_zero_test_features_reports_at_most_chance(tiny_dataset, tmp_path):
    """Zero test features (random training features) must not give a perfect table."""
    from experiments import common
    from tf_twobranch.data.retrieval_data import load_caption_splits
    splits = load_caption_splits(tiny_dataset)
    train, test = splits["train"], splits["test"]
    rng = np.random.default_rng(0)
    files = {"image_features_train": rng.normal(size=(train.num_images, 6)),
             "text_features_train": rng.normal(size=(train.num_captions, 5)),
             "image_features_test": np.zeros((test.num_images, 6)),
             "text_features_test": np.zeros((test.num_captions, 5))}
    for name, array in files.items():
        np.save(tmp_path / f"{name}.npy", array.astype(np.float32))
    run_dir = tmp_path / "run"
    proc = run_python(
        ["-m", "experiments.two_branch_retrieval",
         f"--flagfile={common.REPO_ROOT / 'experiments/configs/two_branch_table2_b4_nonlinear_bidir.cfg'}",
         f"--dataset_dir={tiny_dataset}", f"--run_dir={run_dir}", *TINY_FLAGS,
         *[f"--{name}={tmp_path / (name + '.npy')}" for name in files]],
        cwd=common.REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    record = json.loads((run_dir / "results.json").read_text())
    assert record["num_test_images"] == test.num_images
    metrics = record["metrics"]
    chance = chance_recalls(test.caption_image, test.num_images, bound=True)
    for direction in ("i2t", "t2i"):
        assert metrics[f"{direction}_r1"] <= chance[f"{direction}_r1"], (direction, metrics, chance)
    assert_at_or_below_chance(metrics, test.caption_image, test.num_images)
    assert metrics["rsum"] <= record["random_baseline"]["rsum"]
    # Sentence-to-sentence retrieval on the zero captions is collapsed as well: a caption
    # with c - 1 positives among the M - 1 others, R@K <= K (c - 1) / (M - 1).
    counts = np.bincount(test.caption_image)
    m = test.num_captions
    s2s = record["sentence_retrieval"]
    for k in KS:
        bound = 100.0 * float(np.mean([min(1.0, k * (counts[i] - 1) / (m - 1))
                                       for i in test.caption_image]))
        assert s2s[f"s2s_r{k}"] <= bound + 1e-9, (k, s2s, bound)
