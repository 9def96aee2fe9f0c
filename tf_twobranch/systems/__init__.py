"""The four paper systems, one folder each, over the shared core of the package.

* `two_branch`: two-branch embedding and similarity networks (Wang, Li, Huang, Lazebnik, TPAMI 2018;
  CVPR 2016): image–sentence retrieval, the region–phrase model of Algorithm 1, the CCA baseline;
* `dual_path`: the dual-path CNN with the instance loss (Zheng et al.);
* `fragments`: deep fragment embeddings (Karpathy, Joulin, Fei-Fei);
* `npair`: N-pair phrase localization and its word/phrase heat maps (Das et al.).

A system folder holds what only its paper needs (model, losses, batch sampling, feature
preparation, the pipeline that runs a row, its export, evaluation pieces and figures) and imports
no other system folder; what two systems share lives in the core (`tf_twobranch.data`,
`features`, `evaluation`, `training`, `export` plumbing, `recipes`).
"""
from tf_twobranch.systems.registry import (LeaderboardLine, LeaderboardRun, LeaderboardSibling, Ordering, RunTask,
                                           Side, System, all_systems, for_model, for_task, get, leaderboard_lines,
                                           leaderboard_orderings, leaderboard_siblings, register, tasks, unregister)
from tf_twobranch.systems.two_branch.system import SYSTEM as _TWO_BRANCH
from tf_twobranch.systems.dual_path.system import SYSTEM as _DUAL_PATH
from tf_twobranch.systems.fragments.system import SYSTEM as _FRAGMENTS
from tf_twobranch.systems.npair.system import SYSTEM as _NPAIR

for _system in (_TWO_BRANCH, _DUAL_PATH, _FRAGMENTS, _NPAIR):
    register(_system)

all = all_systems   # noqa: A001  `systems.all()`, as `systems.get(name)`

__all__ = ["RunTask", "System", "LeaderboardLine", "LeaderboardRun", "LeaderboardSibling", "Ordering", "Side",
           "register", "unregister", "get", "all", "for_task", "for_model", "tasks", "leaderboard_lines",
           "leaderboard_siblings", "leaderboard_orderings"]

