"""The four model families, one module each, on the contract of `models.base`.

* `two_branch`: two-branch embedding and similarity networks (Wang et al.), with `branches` and `text_towers`;
* `dual_path`: the dual-path CNN with the instance loss (Zheng et al.);
* `fragment_embedding`: deep fragment embeddings (Karpathy, Joulin, Fei-Fei);
* `npair_localization`: N-pair phrase localization (Das et al.).

`base`: the configuration base class, its one saver/loader, and the contract
(builder, `objective`, `evaluate`); `evaluation_input`: what every
`evaluate` takes.
"""
