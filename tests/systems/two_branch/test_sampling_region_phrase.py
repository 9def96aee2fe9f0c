"""Algorithm 1 (TPAMI 2018) phrase-localization batches on hand-built data."""
import numpy as np
import pytest

from tf_twobranch.boxes import iou_matrix
from tf_twobranch.data import phrase_localization_data as pld
from tf_twobranch.data.phrases import PhraseExample
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.systems.two_branch import region_phrase_sampling as pl


def _example(image, chain, phrase, box, types=("people",)):
    box = np.asarray(box, np.float32)
    return PhraseExample(image_id=image, sentence_index=0, phrase_index=0, phrase=phrase, chain_id=chain,
                         phrase_types=list(types), gt_box=box, gt_boxes=box[None])


# Image "a": chain 1 (three phrases) and chain 2 (one); "b": chain 5 (two); "c": chain 7.
EXAMPLES = [
    _example("a", "1", "a man", [10, 10, 49, 49]),
    _example("a", "1", "the guy", [10, 10, 49, 49]),
    _example("a", "1", "he", [10, 10, 49, 49]),
    _example("a", "2", "a dog", [60, 60, 99, 99], ("animals",)),
    _example("b", "5", "a cat", [0, 0, 29, 29], ("animals",)),
    _example("b", "5", "the cat", [0, 0, 29, 29], ("animals",)),
    _example("c", "7", "a man", [20, 20, 59, 59]),
]
PROPOSALS = {
    "a": np.array([[10, 10, 49, 49], [11, 11, 50, 50], [60, 60, 99, 99], [0, 0, 5, 5], [100, 0, 120, 20],
                   [10, 10, 69, 69], [61, 61, 100, 100], [12, 10, 49, 49]], np.float32),
    "b": np.array([[0, 0, 29, 29], [1, 0, 29, 29], [50, 50, 80, 80], [40, 0, 60, 20]], np.float32),
    "c": np.array([[20, 20, 59, 59], [0, 0, 10, 10], [70, 70, 90, 90], [21, 20, 59, 59]], np.float32),
}


def make_data(examples=EXAMPLES, proposals=PROPOSALS, dim=3):
    rng = np.random.default_rng(0)
    gt = pld.ground_truth_regions(examples)
    return pld.build_phrase_localization_data(
        examples, proposals, {k: rng.normal(size=(len(v), dim)).astype(np.float32) for k, v in proposals.items()},
        {k: rng.normal(size=(len(boxes), dim)).astype(np.float32) for k, (_, boxes) in gt.items()},
        rng.normal(size=(len(examples), 4)).astype(np.float32))


def random_data(num_images=6, seed=1):
    """Images with 2-3 chains of 1-3 phrases and jittered proposals around them."""
    rng = np.random.default_rng(seed)
    examples, proposals = [], {}
    for i in range(num_images):
        image = f"img{i}"
        boxes = []
        for c in range(int(rng.integers(2, 4))):
            x, y = rng.integers(0, 200, size=2)
            w, h = rng.integers(30, 80, size=2)
            gt = np.array([x, y, x + w, y + h], np.float32)
            for k in range(int(rng.integers(1, 4))):
                examples.append(_example(image, str(c + 1), f"phrase {c} {k}", gt))
            jitter = rng.integers(-6, 7, size=(int(rng.integers(0, 4)), 4)).astype(np.float32)
            boxes += list(np.maximum(gt[None] + jitter, 0))
        for _ in range(8):
            x, y = rng.integers(0, 280, size=2)
            boxes.append(np.array([x, y, x + rng.integers(5, 60), y + rng.integers(5, 60)], np.float32))
        proposals[image] = np.stack(boxes)
    return make_data(examples, proposals)


def chain_key(data, p):
    return (data.examples[p].image_id, data.examples[p].chain_id)


def true_iou(data, p, r):
    if data.examples[p].image_id != data.image_ids[data.region_image[r]]:
        return None
    return float(iou_matrix(data.examples[p].gt_box, data.region_boxes[r])[0, 0])


def check_batch(data, batch):
    phrases = batch["phrase_index"][batch["phrase_valid"]]
    regions = batch["region_index"][batch["region_valid"]]
    P, R = len(phrases), len(regions)
    pos = batch["phrase_region_positive"]
    neg = batch["phrase_region_negative"]
    assert not pos[P:].any() and not pos[:, R:].any() and not neg[P:].any() and not neg[:, R:].any()
    assert pos.any()
    for i, j in zip(*np.nonzero(pos)):
        iou = true_iou(data, phrases[i], regions[j])
        assert iou is not None and iou >= 0.7 and batch["region_is_target"][j]
    for i, j in zip(*np.nonzero(neg)):  # (y, x, x'): same image, IoU < 0.3
        iou = true_iou(data, phrases[i], regions[j])
        assert iou is not None and iou < 0.3
    ppn = batch["phrase_phrase_negative"]
    for i in range(len(ppn)):
        for j in range(len(ppn)):
            if i < P and j < P:  # (x, y, y'): y' outside y's chain
                assert ppn[i, j] == (chain_key(data, phrases[i]) != chain_key(data, phrases[j]))
                assert batch["phrase_neighbours"][i, j] == (not ppn[i, j])
            else:
                assert not ppn[i, j]
    # every anchor has its positive region in the batch
    for i in range(P):
        assert pos[i].any()


def test_data_layout():
    data = make_data()
    assert data.image_ids == ["a", "b", "c"]
    assert data.num_chains == 4
    np.testing.assert_array_equal(data.num_proposals, [8, 4, 4])
    np.testing.assert_array_equal(data.image_region_offsets, [0, 10, 15, 20])
    np.testing.assert_array_equal(np.flatnonzero(data.region_is_gt), [8, 9, 14, 19])
    np.testing.assert_array_equal(data.chain_gt_region, [8, 9, 14, 19])
    assert data.region_features.shape == (20, 3)
    np.testing.assert_array_equal(data.phrase_chain, [0, 0, 0, 1, 2, 2, 3])
    assert data.phrase_key[0] == data.phrase_key[6]  # "a man" twice
    iou, valid = data.phrase_proposal_iou()
    assert iou.shape == (7, 8) and valid.sum() == 4 * 8 + 2 * 4 + 4
    assert iou[0, 0] == pytest.approx(1.0) and iou[6, 3] > 0.9 and iou[4, 5] == -1.0
    for p in range(7):
        np.testing.assert_allclose(iou[p, valid[p]], iou_matrix(data.examples[p].gt_box,
                                                              PROPOSALS[data.examples[p].image_id])[0])


def test_missing_features_are_reported():
    gt = pld.ground_truth_regions(EXAMPLES)
    with pytest.raises(DataFormatError, match="'c'"):
        pld.build_phrase_localization_data(
            EXAMPLES, PROPOSALS, {k: np.zeros((len(v), 2)) for k, v in PROPOSALS.items() if k != "c"},
            {k: np.zeros((len(b), 2)) for k, (_, b) in gt.items()}, np.zeros((7, 2)))
    with pytest.raises(DataFormatError, match="rows"):
        pld.build_phrase_localization_data(
            EXAMPLES, PROPOSALS, {k: np.zeros((len(v), 2)) for k, v in PROPOSALS.items()},
            {k: np.zeros((len(b), 2)) for k, (_, b) in gt.items()}, np.zeros((5, 2)))


@pytest.mark.parametrize("augment,neighbourhood", [(False, False), (True, False), (True, True)])
def test_candidates_respect_chains_and_iou(augment, neighbourhood):
    for data in (make_data(), random_data()):
        sampler = pl.PhraseTripletSampler(data, batch_size=4, augment_positives=augment,
                                          neighbourhood_sampling=neighbourhood, seed=3)
        for step in range(2 * sampler.steps_per_epoch):
            check_batch(data, sampler.batch(step))


def test_positive_region_augmentation():
    data = random_data()
    for augment in (False, True):
        sampler = pl.PhraseTripletSampler(data, batch_size=5, augment_positives=augment, seed=0)
        for step in range(sampler.steps_per_epoch):
            batch = sampler.batch(step)
            anchors = batch["phrase_index"][:5]
            for p in anchors:
                chain = data.phrase_chain[p]
                regions, iou, is_prop = pl._chain_regions(data, chain)
                has_augmented = bool((is_prop & (iou >= 0.7)).any())
                targets = batch["region_index"][batch["region_is_target"]]
                mine = [r for r in targets if true_iou(data, p, r) is not None and true_iou(data, p, r) >= 0.7]
                if augment and has_augmented:
                    assert any(not data.region_is_gt[r] for r in mine)
                if not augment:
                    assert mine == [data.chain_gt_region[chain]] or data.chain_gt_region[chain] in mine
                    assert all(data.region_is_gt[r] for r in targets)


def test_anchor_sets_cover_the_epoch_and_are_deterministic():
    data = random_data()
    sampler = pl.PhraseTripletSampler(data, batch_size=4, seed=5)
    epoch = np.concatenate([sampler.anchors(s) for s in range(sampler.steps_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch) == 4 * sampler.steps_per_epoch
    again = pl.PhraseTripletSampler(data, batch_size=4, seed=5)
    other = pl.PhraseTripletSampler(data, batch_size=4, seed=6)
    for step in (0, 1, sampler.steps_per_epoch + 1):
        a, b = sampler.batch(step), again.batch(step)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert any(not np.array_equal(sampler.batch(s)["phrase_index"], other.batch(s)["phrase_index"])
               for s in range(3))
    # the second epoch is another permutation
    assert not np.array_equal(sampler.anchors(0), sampler.anchors(sampler.steps_per_epoch))


def test_dataset_matches_numpy_batches():
    data = make_data()
    sampler = pl.PhraseTripletSampler(data, batch_size=3, neighbourhood_sampling=True, seed=2)
    for step, batch in enumerate(sampler.dataset().take(3)):
        expected = sampler.batch(step)
        for key, value in expected.items():
            np.testing.assert_array_equal(batch[key].numpy(), value)
    featured = pl.attach_phrase_features(sampler.dataset().take(1), data)
    batch = next(iter(featured))
    np.testing.assert_array_equal(batch["image"].numpy(), data.region_features[batch["region_index"].numpy()])
    np.testing.assert_array_equal(batch["text"].numpy(), data.phrase_features[batch["phrase_index"].numpy()])


def test_neighbourhood_sampling():
    for data in (make_data(), random_data(num_images=8, seed=4)):
        sampler = pl.PhraseTripletSampler(data, batch_size=3, neighbourhood_sampling=True, seed=1)
        for step in range(2 * sampler.steps_per_epoch):
            batch = sampler.batch(step)
            phrases = batch["phrase_index"][batch["phrase_valid"]]
            pos = batch["phrase_region_positive"][:len(phrases)]
            for j in np.flatnonzero(batch["region_is_target"]):
                positives = np.flatnonzero(pos[:, j])
                chain_sizes = [len(sampler.chain_members[data.phrase_chain[phrases[i]]]) for i in positives]
                if max(chain_sizes) >= 2 or len(positives) >= 2:
                    assert len(positives) >= 2, (step, j)
            for i, p in enumerate(phrases):
                regions, iou, is_prop = pl._chain_regions(data, data.phrase_chain[p])
                available = int((is_prop & (iou >= 0.7)).sum()) + 1  # + the ground truth
                if available >= 2:
                    assert pos[i].sum() >= 2, (step, i)
            nbrs = batch["region_neighbours"]
            for j in np.flatnonzero(batch["region_is_target"]):
                expected = (pos[:, j][:, None] & pos).any(0)
                expected[j] = True
                np.testing.assert_array_equal(nbrs[j][batch["region_valid"]], expected[:batch["region_valid"].sum()])
    # hand-built: "a cat" alone in a batch gets "the cat" added
    data = make_data()
    sampler = pl.PhraseTripletSampler(data, batch_size=2, neighbourhood_sampling=True, seed=0)
    for step in range(20):
        batch = sampler.batch(step)
        phrases = batch["phrase_index"][batch["phrase_valid"]].tolist()
        if 4 in phrases:
            assert 5 in phrases
        if 5 in phrases:
            assert 4 in phrases


def test_negative_cap_and_sizes():
    data = random_data()
    sampler = pl.PhraseTripletSampler(data, batch_size=4, negatives_per_phrase=2, seed=0)
    assert sampler.num_region_slots == 4 + 4 * 2
    batch = sampler.batch(0)
    chains = set(data.phrase_chain[batch["phrase_index"][batch["phrase_valid"]]].tolist())
    num_negative_regions = int((batch["region_valid"] & ~batch["region_is_target"]).sum())
    assert 0 < num_negative_regions <= 2 * len(chains)
    full = pl.PhraseTripletSampler(data, batch_size=4, seed=0)
    counts = full.batch(0)["phrase_region_negative"].sum(1)[:4]
    for i, p in enumerate(full.batch(0)["phrase_index"][:4]):
        regions, iou, _ = pl._chain_regions(data, data.phrase_chain[p])
        assert counts[i] == int(((iou >= 0) & (iou < 0.3)).sum())  # all of them, as the paper
    with pytest.raises(ConfigError):
        pl.PhraseTripletSampler(data, batch_size=10_000)


def test_similarity_pairs_are_balanced():
    for augment in (False, True):
        data = random_data()
        sampler = pl.PhrasePairSampler(data, batch_size=4, augment_positives=augment, seed=2)
        for step in range(sampler.steps_per_epoch + 1):
            batch = sampler.batch(step)
            mask, labels = batch["pair_mask"], batch["labels"]
            S = len(mask) // 2
            np.testing.assert_array_equal(mask[:S], mask[S:])
            assert (labels[mask] == 1).sum() == (labels[mask] == 0).sum() > 0
            for k in np.flatnonzero(mask):
                p, r = batch["phrase_index"][k], batch["region_index"][k]
                iou = true_iou(data, p, r)
                assert iou is not None
                if labels[k]:
                    assert iou >= 0.7 and (augment or data.region_is_gt[r])
                else:
                    assert iou < 0.3 and not data.region_is_gt[r]
            # with augmentation every IoU >= 0.7 proposal of each anchor is a positive
            if augment:
                for p in sampler.anchors(step):
                    regions, iou, is_prop = pl._chain_regions(data, data.phrase_chain[p])
                    got = set(batch["region_index"][:S][mask[:S] & (batch["phrase_index"][:S] == p)].tolist())
                    assert set(regions[is_prop & (iou >= 0.7)].tolist()) <= got
        again = pl.PhrasePairSampler(data, batch_size=4, augment_positives=augment, seed=2)
        ds = next(iter(again.dataset().take(1)))
        for key, value in sampler.batch(0).items():
            np.testing.assert_array_equal(ds[key].numpy(), value)


def test_hard_negatives():
    data = make_data()
    rng = np.random.default_rng(0)
    region_embeds = rng.normal(size=(len(data.region_image), 4)).astype(np.float32)
    region_embeds /= np.linalg.norm(region_embeds, axis=1, keepdims=True)
    phrase_embeds = rng.normal(size=(len(data.phrase_features), 4)).astype(np.float32)
    phrase_embeds /= np.linalg.norm(phrase_embeds, axis=1, keepdims=True)
    mined = pl.mine_hard_negatives(data, region_embeds, phrase_embeds, max_per_phrase=50)
    expected = {}
    for p in range(data.num_phrases):
        gt = data.chain_gt_region[data.phrase_chain[p]]
        d_gt = np.linalg.norm(phrase_embeds[p] - region_embeds[gt])
        for r in np.flatnonzero((data.region_image == data.phrase_image[p]) & ~data.region_is_gt):
            if true_iou(data, p, r) < 0.3 and np.linalg.norm(phrase_embeds[p] - region_embeds[r]) < d_gt:
                expected.setdefault(int(data.phrase_key[p]), set()).add(int(r))
    got = {k: set(v.tolist()) for k, v in mined.by_key().items()}
    assert got == expected and got
    capped = pl.mine_hard_negatives(data, region_embeds, phrase_embeds, max_per_phrase=1)
    assert max(len(v) for v in capped.by_key().values()) == 1
    # hard negatives of "a man" (image a and c) are negatives of both occurrences
    sampler = pl.PhraseTripletSampler(data, batch_size=7, hard_negatives=mined, seed=0)
    batch = sampler.batch(0)
    regions = batch["region_index"].tolist()
    for i, p in enumerate(batch["phrase_index"][batch["phrase_valid"]]):
        for r in expected.get(int(data.phrase_key[p]), ()):
            j = regions.index(r)
            assert batch["phrase_region_negative"][i, j]
