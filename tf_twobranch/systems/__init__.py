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
