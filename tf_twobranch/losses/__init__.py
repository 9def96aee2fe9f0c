"""Losses of the four families (two-branch networks, the dual-path CNN, deep fragment embeddings, N-pair localization), one module per paper family.

* `common`: distances and top-K hinges (dynamic and static-shape) of `ranking` and `phrase_localization`.
* `ranking`: two-branch image–sentence losses, TPAMI 2018 eqs. 1–7; Keras `LogisticPairLoss`.
* `phrase_localization`: the ranking loss on Algorithm 1 phrase–region batches (TPAMI 2018; CVPR 2016).
* `instance`: dual-path CNN losses (Zheng et al. 2020); Keras `InstanceLoss`, `CosineRankingLoss`.
* `fragment`: deep fragment embedding objectives (Karpathy et al. 2014, eqs. 4–7; import the module).
* `npair`: N-pair and hardest-negative triplet losses on localization-volume scores (Das et al., eqs. 2–7); Keras `NPairLoss`, `HardestNegativeTripletLoss`.
* `localization_volume`: the localization volume m_{r,c,t} = a_{r,c}·s_t and its scores, S_MaxImage and the code's aggregators (Das et al., eq. 1; import the module).

Every loss is a pure function of tensors. A `keras.losses.Loss` class exists
only where the loss has per-example values (Keras reduces and weights them);
the batch-level ranking objectives have none (see `ranking` and
`phrase_localization`).

The names below are re-exported so that `from tf_twobranch import losses;
losses.bidirectional_ranking_loss(...)` works. Tuning constants are not
re-exported: patch them where they are read (e.g.
`losses.common.FALLBACK_ELEMENTS`).
"""
from tf_twobranch.losses.common import DISTANCE_EPSILON, HINGE_MAX, pairwise_distance
from tf_twobranch.losses.instance import (RANKING_NEGATIVES, CosineRankingLoss, InstanceLoss,
                                          cosine_ranking_loss, cosine_similarity_matrix,
                                          instance_loss)
from tf_twobranch.losses.npair import (BATCH_LOSSES, HardestNegativeTripletLoss, NPairLoss,
                                       hardest_negative_triplet_loss, localization_batch_loss,
                                       npair_loss)
from tf_twobranch.losses.phrase_localization import (phrase_localization_batch_loss,
                                                     phrase_localization_loss)
from tf_twobranch.losses.ranking import (LogisticPairLoss, bidirectional_ranking_loss,
                                         embedding_loss, image_anchor_ranking_loss,
                                         logistic_pair_loss, masked_logistic_pair_loss,
                                         neighbourhood_loss, text_anchor_ranking_loss)

__all__ = [
    # common
    "DISTANCE_EPSILON", "HINGE_MAX", "pairwise_distance",
    # ranking
    "text_anchor_ranking_loss", "image_anchor_ranking_loss", "neighbourhood_loss",
    "bidirectional_ranking_loss", "embedding_loss", "logistic_pair_loss",
    "masked_logistic_pair_loss", "LogisticPairLoss",
    # phrase_localization
    "phrase_localization_loss", "phrase_localization_batch_loss",
    # instance
    "RANKING_NEGATIVES", "instance_loss", "cosine_similarity_matrix", "cosine_ranking_loss",
    "InstanceLoss", "CosineRankingLoss",
    # npair
    "BATCH_LOSSES", "npair_loss", "hardest_negative_triplet_loss", "localization_batch_loss",
    "NPairLoss", "HardestNegativeTripletLoss",
]
