"""The losses' shared pieces; each system's own losses live in its folder.

* `common`: distances and top-K hinges (dynamic and static-shape) of the two-branch losses
  (`tf_twobranch.systems.two_branch.losses`, eqs. 1–7, and `region_phrase_losses`, Algorithm 1).

The systems' losses: `systems.dual_path.losses` (instance and cosine ranking losses, Zheng et al.),
`systems.fragments.losses` (Karpathy et al. eqs. 4–7), `systems.npair.losses` (N-pair and
hardest-negative triplet, Das et al. eqs. 2–7) on `systems.npair.heat_map_volume` (eq. 1).
Every loss is a pure function of tensors. A `keras.losses.Loss` class exists
only where the loss has per-example values (Keras reduces and weights them);
the batch-level ranking objectives have none.
"""
from tf_twobranch.losses.common import DISTANCE_EPSILON, HINGE_MAX, pairwise_distance

__all__ = ["DISTANCE_EPSILON", "HINGE_MAX", "pairwise_distance"]
