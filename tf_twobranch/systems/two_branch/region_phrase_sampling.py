"""Phrase-localization mini-batches (TPAMI 2018 §4.1, Algorithm 1).

The data of a split is a
:class:`~tf_twobranch.data.phrase_localization_data.PhraseLocalizationData`
(regions, phrases, coreference chains; see that module); the samplers here
draw index batches from it.

Embedding-network batches (:class:`PhraseTripletSampler`)
---------------------------------------------------------
Per epoch the phrase occurrences (= ground-truth region–phrase pairs) are
shuffled under ``(seed, epoch)`` and cut into sets of ``batch_size`` (100);
random choices inside a batch depend only on ``(seed, step)``, so any batch
can be rebuilt on its own. Each batch is a dict of fixed-size arrays
(``Pb`` phrase slots, ``Rb`` region slots, padding marked by the masks):

``phrase_index`` int64 (Pb,)
    phrase occurrence (row of ``examples``); anchors first, then phrases
    added by neighbourhood sampling.
``region_index`` int64 (Rb,)
    global region; *target* regions (positives of some phrase) first, then
    negative regions.
``phrase_valid`` (Pb,), ``region_valid`` (Rb,), ``region_is_target`` (Rb,) bool
``phrase_region_positive`` bool (Pb, Rb)
    same image, target region, IoU ≥ 0.7 with the phrase's ground truth
    (the ground-truth region itself has IoU 1). Every True entry is one
    positive pair (x, y) = one anchor row of both ranking terms.
``phrase_region_negative`` bool (Pb, Rb)
    candidates x′ of the triplets (y, x, x′): regions of the phrase's image
    with IoU < 0.3 with its ground truth, plus mined hard negatives.
``phrase_phrase_negative`` bool (Pb, Pb)
    candidates y′ of the triplets (x, y, y′): valid phrases outside y's
    coreference chain (the loss also drops y′ that are positives of x).
``phrase_neighbours`` bool (Pb, Pb)
    same coreference chain (diagonal included) — the λ4 neighbourhoods.
``region_neighbours`` bool (Rb, Rb)
    target regions sharing a positive phrase (diagonal included) — λ3.

The top-K selection of Algorithm 1 ("keep at most K=30 with highest
non-negative loss") depends on the current embeddings, so the sampler emits
*all* candidates and :func:`tf_twobranch.systems.two_branch.region_phrase_losses.phrase_localization_loss`
keeps the K largest violations per positive pair.

Sizes: ``Pb = batch_size`` (``2·batch_size`` with neighbourhood sampling),
``Rb = batch_size`` target slots (``3·batch_size`` with neighbourhood
sampling) ``+ batch_size · negatives_per_phrase`` (or the
largest number of negatives of any chain when it is ``None``: all of them,
as the paper) ``+ Pb · max_hard_negatives`` when hard negatives are
given. Negative regions of phrases from the same image are shared.

Similarity-network batches (:class:`PhrasePairSampler`)
-------------------------------------------------------
Same shuffled sets of 100; for each pair all positive regions (IoU ≥ 0.7
proposals plus the ground truth with augmentation, else the ground truth)
and for each positive one negative (a random proposal of the same image
with IoU < 0.3). Dict of (2S,) arrays: ``region_index``, ``phrase_index``,
``labels`` (int32 1/0) and ``pair_mask``; positives fill the first S slots,
their negatives the same slots of the second half, so the valid pairs are
balanced exactly (a positive without any negative candidate is dropped).

Padded index slots repeat the batch's valid indices (their masks are
False), so padded rows fed through the towers do not distort batch-norm
statistics. Features are gathered outside the graph by
:func:`attach_phrase_features`.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import tensorflow as tf

from tf_twobranch.data.phrase_localization_data import PhraseLocalizationData
from tf_twobranch.errors import ConfigError

POSITIVE_IOU = 0.7
NEGATIVE_IOU = 0.3


def _members(groups: np.ndarray, num_groups: int) -> list[np.ndarray]:
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], np.arange(num_groups + 1))
    return [order[bounds[g]:bounds[g + 1]] for g in range(num_groups)]


def _pair_iou(data: PhraseLocalizationData, phrases: np.ndarray, regions: np.ndarray):
    """(len(phrases), len(regions)) same-image mask and IoU with each phrase's ground truth (-1 elsewhere)."""
    phrase_image = data.phrase_image[phrases]
    same = phrase_image[:, None] == data.region_image[regions][None, :]
    local = regions[None, :] - data.image_region_offsets[phrase_image][:, None]
    local = np.clip(local, 0, data.chain_region_iou.shape[1] - 1)
    iou = data.chain_region_iou[data.phrase_chain[phrases][:, None], local]
    return same, np.where(same, iou, -1.0)


def _chain_regions(data: PhraseLocalizationData, chain: int):
    """(global region indices, IoUs, is-proposal mask) of the chain's image."""
    image = data.chain_image[chain]
    lo, hi = data.image_region_offsets[image], data.image_region_offsets[image + 1]
    regions = np.arange(lo, hi)
    return regions, data.chain_region_iou[chain, :hi - lo], regions - lo < data.num_proposals[image]


# --------------------------------------------------------------------------- hard negatives


@dataclasses.dataclass
class HardNegatives:
    """Mined hard negatives: region ``region_index[h]`` is a negative of every
    occurrence of the phrase string ``phrase_key[h]`` (see ``PhraseLocalizationData.phrase_key``)."""

    phrase_key: np.ndarray
    region_index: np.ndarray

    def by_key(self) -> dict[int, np.ndarray]:
        out = collections.defaultdict(list)
        for key, region in zip(self.phrase_key.tolist(), self.region_index.tolist()):
            out[key].append(region)
        return {key: np.asarray(regions, np.int64) for key, regions in out.items()}


def mine_hard_negatives(data: PhraseLocalizationData, region_embeds: np.ndarray, phrase_embeds: np.ndarray,
                        *, max_per_phrase: int = 50) -> HardNegatives:
    """CVPR 2016 hard-negative stage for phrase localization.

    For each phrase occurrence, the proposals of its image with IoU < 0.3
    with its ground truth that are *closer* to the phrase than its
    ground-truth region are hard negatives; per unique phrase string at most
    ``max_per_phrase`` are kept — the most violating ones (largest
    d(gt) − d(negative), ties by region index), a deterministic choice
    where the paper "samples". Training then continues with these extra
    negatives (``PhraseTripletSampler(hard_negatives=...)``) and the
    bi-directional terms only (λ3 = λ4 = 0).

    Args:
      region_embeds: (R, d) embeddings of all regions (L2-normalised).
      phrase_embeds: (U, d) embeddings of the rows of ``data.phrase_features``.
    """
    region_embeds = np.asarray(region_embeds, np.float32)
    phrase_embeds = np.asarray(phrase_embeds, np.float32)
    if region_embeds.shape[0] != len(data.region_image):
        raise ConfigError(f"region_embeds has {region_embeds.shape[0]} rows for {len(data.region_image)} regions")
    if phrase_embeds.shape[0] != len(data.phrase_features):
        raise ConfigError(f"phrase_embeds has {phrase_embeds.shape[0]} rows for "
                          f"{len(data.phrase_features)} phrase feature rows")
    if max_per_phrase < 1:
        raise ConfigError(f"max_per_phrase must be >= 1, got {max_per_phrase}")
    keys, regions, violations = [], [], []
    for image, members in enumerate(_members(data.phrase_image, len(data.image_ids))):
        if len(members) == 0:
            continue
        lo = data.image_region_offsets[image]
        proposals = np.arange(lo, lo + data.num_proposals[image])
        text = phrase_embeds[data.phrase_feature_index[members]]
        dist = _euclidean(text, region_embeds[proposals])
        gt_dist = _euclidean(text, region_embeds[data.chain_gt_region[data.phrase_chain[members]]],
                             rowwise=True)
        _, iou = _pair_iou(data, members, proposals)
        hard = (iou >= 0) & (iou < NEGATIVE_IOU) & (dist < gt_dist[:, None])
        rows, cols = np.nonzero(hard)
        keys.append(data.phrase_key[members[rows]])
        regions.append(proposals[cols])
        violations.append(gt_dist[rows] - dist[rows, cols])
    keys_a = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    regions_a = np.concatenate(regions) if regions else np.zeros(0, np.int64)
    viol_a = np.concatenate(violations) if violations else np.zeros(0, np.float32)
    # A region can be mined twice for one key (two occurrences in one image).
    order = np.lexsort((regions_a, -viol_a, keys_a))
    keys_a, regions_a = keys_a[order], regions_a[order]
    first = np.ones(len(order), bool)
    seen = set()
    for i, pair in enumerate(zip(keys_a.tolist(), regions_a.tolist())):
        first[i] = pair not in seen
        seen.add(pair)
    keys_a, regions_a = keys_a[first], regions_a[first]
    start = np.searchsorted(keys_a, keys_a, side="left")
    keep = (np.arange(len(keys_a)) - start) < max_per_phrase
    return HardNegatives(phrase_key=keys_a[keep].astype(np.int64), region_index=regions_a[keep].astype(np.int64))


def _euclidean(a: np.ndarray, b: np.ndarray, rowwise: bool = False) -> np.ndarray:
    if rowwise:
        return np.sqrt(np.maximum(np.sum((a - b) ** 2, axis=1), 0.0))
    sq = (a * a).sum(1)[:, None] - 2.0 * a @ b.T + (b * b).sum(1)[None, :]
    return np.sqrt(np.maximum(sq, 0.0))


# --------------------------------------------------------------------------- embedding network


class PhraseTripletSampler:
    """Algorithm 1, embedding network: index batches with candidate masks.

    Args:
      data: the training split.
      batch_size: ground-truth region–phrase pairs per batch (100).
      augment_positives: step 2, replace the ground-truth region by a random
        proposal with IoU ≥ 0.7 (keep the ground truth when there is none).
      neighbourhood_sampling: step 3c.
      negatives_per_phrase: cap on the IoU < 0.3 regions drawn per
        coreference chain of the batch (None = all, as the paper; a cap
        bounds the batch's memory). A phrase's candidates are all batch
        regions of its image with IoU < 0.3, so negatives drawn for another
        chain of the same image count too.
      hard_negatives: mined hard negatives (CVPR 2016) added to the batch.
      max_hard_negatives: hard-negative slots per anchor phrase.
      seed: every random choice derives from (seed, epoch) or (seed, step).
    """

    def __init__(self, data: PhraseLocalizationData, *, batch_size: int = 100,
                 augment_positives: bool = True, neighbourhood_sampling: bool = False,
                 negatives_per_phrase: int | None = None, hard_negatives: HardNegatives | None = None,
                 max_hard_negatives: int = 50, seed: int = 0):
        if batch_size < 2:
            raise ConfigError(f"batch_size must be >= 2, got {batch_size}")
        if batch_size > data.num_phrases:
            raise ConfigError(f"batch_size={batch_size} exceeds the number of phrase examples "
                              f"({data.num_phrases})")
        if negatives_per_phrase is not None and negatives_per_phrase < 1:
            raise ConfigError(f"negatives_per_phrase must be >= 1 or None, got {negatives_per_phrase}")
        if seed < 0:
            raise ConfigError(f"seed must be >= 0, got {seed}")
        self.data = data
        self.batch_size = int(batch_size)
        self.augment_positives = augment_positives
        self.neighbourhood_sampling = neighbourhood_sampling
        self.seed = int(seed)
        self.steps_per_epoch = data.num_phrases // self.batch_size
        self.chain_members = _members(data.phrase_chain, data.num_chains)
        max_negatives = int(((data.chain_region_iou >= 0) & (data.chain_region_iou < NEGATIVE_IOU)).sum(1).max())
        self.negatives_per_phrase = max_negatives if negatives_per_phrase is None \
            else min(int(negatives_per_phrase), max_negatives)
        self.hard_negatives = hard_negatives.by_key() if hard_negatives is not None else None
        self.max_hard_negatives = int(max_hard_negatives) if hard_negatives is not None else 0
        # Neighbourhood sampling adds at most one phrase per target region
        # (i) and at most one region per phrase (ii).
        self.num_phrase_slots = self.batch_size * (2 if neighbourhood_sampling else 1)
        self.num_target_slots = self.batch_size * (3 if neighbourhood_sampling else 1)
        self.num_region_slots = (self.num_target_slots + self.batch_size * self.negatives_per_phrase
                                 + self.num_phrase_slots * self.max_hard_negatives)

    # -- the pieces of Algorithm 1 ---------------------------------------------------
    def anchors(self, step: int) -> np.ndarray:
        """Step 1: the phrase occurrences (gt region–phrase pairs) of batch ``step``."""
        epoch, within = divmod(int(step), self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.data.num_phrases)
        return perm[within * self.batch_size:(within + 1) * self.batch_size]

    def _positive_region(self, phrase: int, rng: np.random.Generator) -> int:
        chain = self.data.phrase_chain[phrase]
        if self.augment_positives:
            regions, iou, is_proposal = _chain_regions(self.data, chain)
            candidates = regions[is_proposal & (iou >= POSITIVE_IOU)]
            if len(candidates):
                return int(rng.choice(candidates))
        return int(self.data.chain_gt_region[chain])

    def _is_positive(self, phrases: list[int], region: int) -> np.ndarray:
        same, iou = _pair_iou(self.data, np.asarray(phrases, np.int64), np.asarray([region], np.int64))
        return (same & (iou >= POSITIVE_IOU))[:, 0]

    def _neighbourhood(self, phrases: list[int], targets: list[int], rng: np.random.Generator):
        data = self.data
        # (i) every target region gets >= 2 positive phrases (same chain).
        for region in list(targets):
            positives = np.flatnonzero(self._is_positive(phrases, region))
            if len(positives) >= 2 or len(positives) == 0:
                continue
            chain = data.phrase_chain[phrases[positives[0]]]
            candidates = np.setdiff1d(self.chain_members[chain], phrases)
            if len(candidates):
                phrases.append(int(rng.choice(candidates)))
        # (ii) every target phrase gets >= 2 positive regions (same picture).
        for phrase in list(phrases):
            same, iou = _pair_iou(data, np.asarray([phrase]), np.asarray(targets, np.int64))
            if int((same & (iou >= POSITIVE_IOU)).sum()) >= 2:
                continue
            chain = data.phrase_chain[phrase]
            regions, chain_iou, is_proposal = _chain_regions(data, chain)
            candidates = np.setdiff1d(regions[is_proposal & (chain_iou >= POSITIVE_IOU)], targets)
            if len(candidates):
                targets.append(int(rng.choice(candidates)))
            elif data.chain_gt_region[chain] not in targets:
                targets.append(int(data.chain_gt_region[chain]))

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The numpy batch ``step`` (deterministic in (seed, step))."""
        data = self.data
        rng = np.random.default_rng([self.seed, int(step), 1])
        phrases = [int(p) for p in self.anchors(step)]
        targets: list[int] = []
        for phrase in phrases:  # step 2
            region = self._positive_region(phrase, rng)
            if region not in targets:
                targets.append(region)
        if self.neighbourhood_sampling:
            self._neighbourhood(phrases, targets, rng)
        negatives: list[np.ndarray] = []
        for chain in sorted(set(data.phrase_chain[phrases].tolist())):  # step 3b candidates
            regions, iou, _ = _chain_regions(data, chain)
            candidates = regions[(iou >= 0) & (iou < NEGATIVE_IOU)]
            if len(candidates) > self.negatives_per_phrase:
                candidates = np.sort(rng.choice(candidates, self.negatives_per_phrase, replace=False))
            negatives.append(candidates)
        hard_for_key: dict[int, np.ndarray] = {}
        if self.hard_negatives is not None:
            for key in sorted(set(data.phrase_key[phrases].tolist())):
                mined = self.hard_negatives.get(key, np.zeros(0, np.int64))[:self.max_hard_negatives]
                hard_for_key[key] = mined
                negatives.append(mined)
        negative_regions = np.unique(np.concatenate(negatives)) if negatives else np.zeros(0, np.int64)
        negative_regions = np.setdiff1d(negative_regions, targets)
        phrase_array = np.asarray(phrases, np.int64)
        region_array = np.concatenate([np.asarray(targets, np.int64), negative_regions])
        num_p, num_r = len(phrase_array), len(region_array)
        if num_p > self.num_phrase_slots or num_r > self.num_region_slots:
            raise AssertionError("batch exceeds its padded size")  # cannot happen: sizes are upper bounds
        is_target = np.arange(num_r) < len(targets)
        same, iou = _pair_iou(data, phrase_array, region_array)
        positive = same & (iou >= POSITIVE_IOU) & is_target[None, :]
        negative = same & (iou >= 0) & (iou < NEGATIVE_IOU)
        if hard_for_key:
            region_slot = {r: j for j, r in enumerate(region_array.tolist())}
            for i, key in enumerate(data.phrase_key[phrase_array].tolist()):
                cols = [region_slot[r] for r in hard_for_key.get(key, ()) if r in region_slot]
                # never a negative when it overlaps this occurrence's ground truth
                negative[i, cols] |= ~(same[i, cols] & (iou[i, cols] >= NEGATIVE_IOU))
        chain = data.phrase_chain[phrase_array]
        same_chain = chain[:, None] == chain[None, :]
        positive_f = positive.astype(np.float32)
        region_nbrs = (positive_f.T @ positive_f) > 0
        region_nbrs |= np.diag(is_target)

        def pad(array, shape, fill=False):
            out = np.full(shape, fill, dtype=array.dtype)
            out[tuple(slice(0, n) for n in array.shape)] = array
            return out

        P, R = self.num_phrase_slots, self.num_region_slots
        return {
            "phrase_index": _cyclic_pad(phrase_array, P),
            "region_index": _cyclic_pad(region_array, R),
            "phrase_valid": pad(np.ones(num_p, bool), (P,)),
            "region_valid": pad(np.ones(num_r, bool), (R,)),
            "region_is_target": pad(is_target, (R,)),
            "phrase_region_positive": pad(positive, (P, R)),
            "phrase_region_negative": pad(negative, (P, R)),
            "phrase_phrase_negative": pad(~same_chain, (P, P)),
            "phrase_neighbours": pad(same_chain, (P, P)),
            "region_neighbours": pad(region_nbrs, (R, R)),
        }

    def output_signature(self) -> dict[str, tf.TensorSpec]:
        P, R = self.num_phrase_slots, self.num_region_slots
        shapes = {"phrase_index": ((P,), tf.int64), "region_index": ((R,), tf.int64),
                  "phrase_valid": ((P,), tf.bool), "region_valid": ((R,), tf.bool),
                  "region_is_target": ((R,), tf.bool),
                  "phrase_region_positive": ((P, R), tf.bool), "phrase_region_negative": ((P, R), tf.bool),
                  "phrase_phrase_negative": ((P, P), tf.bool), "phrase_neighbours": ((P, P), tf.bool),
                  "region_neighbours": ((R, R), tf.bool)}
        return {k: tf.TensorSpec(shape, dtype, name=k) for k, (shape, dtype) in shapes.items()}

    def dataset(self, start_step: int = 0) -> tf.data.Dataset:
        """An infinite, deterministic tf.data pipeline of :meth:`batch` for steps
        start_step, start_step + 1, …"""
        return _numpy_batches(self.batch, self.output_signature(), start_step)


# --------------------------------------------------------------------------- similarity network


class PhrasePairSampler:
    """Algorithm 1, similarity network: balanced positive/negative pairs.

    Args:
      data: the training split.
      batch_size: ground-truth region–phrase pairs per set (100).
      augment_positives: all proposals with IoU ≥ 0.7 are positives too.
      max_positives_per_phrase: positives kept per pair (a random subset
        beyond it); None = the largest number in the data (keeps all).
      seed: every random choice derives from (seed, epoch) or (seed, step).
    """

    def __init__(self, data: PhraseLocalizationData, *, batch_size: int = 100, augment_positives: bool = True,
                 max_positives_per_phrase: int | None = None, seed: int = 0):
        if batch_size < 1 or batch_size > data.num_phrases:
            raise ConfigError(f"batch_size must be in [1, {data.num_phrases}], got {batch_size}")
        if seed < 0:
            raise ConfigError(f"seed must be >= 0, got {seed}")
        self.data = data
        self.batch_size = int(batch_size)
        self.augment_positives = augment_positives
        self.seed = int(seed)
        self.steps_per_epoch = data.num_phrases // self.batch_size
        if augment_positives:
            is_proposal = np.arange(data.chain_region_iou.shape[1])[None, :] < \
                data.num_proposals[data.chain_image][:, None]
            most = 1 + int(((data.chain_region_iou >= POSITIVE_IOU) & is_proposal).sum(1).max())
        else:
            most = 1
        self.max_positives_per_phrase = most if max_positives_per_phrase is None \
            else max(1, min(int(max_positives_per_phrase), most))
        self.num_pairs = self.batch_size * self.max_positives_per_phrase

    def anchors(self, step: int) -> np.ndarray:
        epoch, within = divmod(int(step), self.steps_per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.data.num_phrases)
        return perm[within * self.batch_size:(within + 1) * self.batch_size]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        data = self.data
        rng = np.random.default_rng([self.seed, int(step), 2])
        pos_region, pos_phrase, neg_region = [], [], []
        for phrase in self.anchors(step).tolist():
            chain = data.phrase_chain[phrase]
            regions, iou, is_proposal = _chain_regions(data, chain)
            negatives = regions[is_proposal & (iou >= 0) & (iou < NEGATIVE_IOU)]
            if len(negatives) == 0:
                continue
            positives = [int(data.chain_gt_region[chain])]
            if self.augment_positives:
                positives += regions[is_proposal & (iou >= POSITIVE_IOU)].tolist()
            if len(positives) > self.max_positives_per_phrase:
                positives = [positives[0]] + sorted(rng.choice(
                    positives[1:], self.max_positives_per_phrase - 1, replace=False).tolist())
            pos_region += positives
            pos_phrase += [phrase] * len(positives)
            neg_region += rng.choice(negatives, len(positives)).tolist()
        S, n = self.num_pairs, len(pos_region)
        region_index = np.zeros(2 * S, np.int64)
        phrase_index = np.zeros(2 * S, np.int64)
        mask = np.zeros(2 * S, bool)
        region_index[:n], region_index[S:S + n] = pos_region, neg_region
        phrase_index[:n], phrase_index[S:S + n] = pos_phrase, pos_phrase
        mask[:n] = mask[S:S + n] = True
        if 0 < n < S:
            for half in (slice(0, S), slice(S, 2 * S)):
                region_index[half] = _cyclic_pad(region_index[half][:n], S)
                phrase_index[half] = _cyclic_pad(phrase_index[half][:n], S)
        labels = np.zeros(2 * S, np.int32)
        labels[:S] = 1
        return {"region_index": region_index, "phrase_index": phrase_index, "labels": labels, "pair_mask": mask}

    def output_signature(self) -> dict[str, tf.TensorSpec]:
        n = 2 * self.num_pairs
        return {"region_index": tf.TensorSpec((n,), tf.int64, name="region_index"),
                "phrase_index": tf.TensorSpec((n,), tf.int64, name="phrase_index"),
                "labels": tf.TensorSpec((n,), tf.int32, name="labels"),
                "pair_mask": tf.TensorSpec((n,), tf.bool, name="pair_mask")}

    def dataset(self, start_step: int = 0) -> tf.data.Dataset:
        return _numpy_batches(self.batch, self.output_signature(), start_step)


def _cyclic_pad(indices: np.ndarray, size: int) -> np.ndarray:
    """Pads by repeating the valid indices: padded rows still go through the
    towers, and repeating real rows keeps batch-norm statistics close to the
    real batch's (index 0 repeated would skew them)."""
    if len(indices) == 0:
        return np.zeros(size, np.int64)
    return np.resize(np.asarray(indices, np.int64), size)


def _numpy_batches(make_batch, signature: dict[str, tf.TensorSpec], start_step: int = 0) -> tf.data.Dataset:
    keys = list(signature)

    def build(step):
        batch = make_batch(int(step))
        return tuple(batch[k] for k in keys)

    def map_fn(step):
        values = tf.numpy_function(build, [step], [signature[k].dtype for k in keys], stateful=False)
        out = {}
        for key, value in zip(keys, values):
            value.set_shape(signature[key].shape)
            out[key] = value
        return out

    # Batch `step` depends on step only, so parallel, ordered mapping is deterministic.
    return tf.data.Dataset.counter(start_step).map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def phrase_embedding_batches(data: PhraseLocalizationData, **kwargs) -> tf.data.Dataset:
    """`PhraseTripletSampler(data, **kwargs).dataset()`."""
    return PhraseTripletSampler(data, **kwargs).dataset()


def phrase_similarity_batches(data: PhraseLocalizationData, **kwargs) -> tf.data.Dataset:
    """`PhrasePairSampler(data, **kwargs).dataset()`."""
    return PhrasePairSampler(data, **kwargs).dataset()


def attach_phrase_features(dataset: tf.data.Dataset, data: PhraseLocalizationData, *,
                           prefetch: int = 2) -> tf.data.Dataset:
    """Adds ``image`` (region features) and ``text`` (phrase features) gathered by index outside the graph."""
    regions = data.region_features
    phrases = data.phrase_features
    feature_row = data.phrase_feature_index

    def gather(batch):
        image = tf.numpy_function(lambda i: np.asarray(regions[i]), [batch["region_index"]],
                                  tf.as_dtype(regions.dtype), stateful=False)
        text = tf.numpy_function(lambda i: np.asarray(phrases[feature_row[i]]), [batch["phrase_index"]],
                                 tf.as_dtype(phrases.dtype), stateful=False)
        image.set_shape([batch["region_index"].shape[0], regions.shape[1]])
        text.set_shape([batch["phrase_index"].shape[0], phrases.shape[1]])
        return {**batch, "image": image, "text": text}

    return dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(prefetch)
