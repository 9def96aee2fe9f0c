"""Two-branch networks (Wang, Li, Huang, Lazebnik, TPAMI 2018; CVPR 2016).

Image–sentence retrieval: `model` (embedding and similarity networks, with `branches` and
`text_towers`), `losses` (the bidirectional ranking and neighbourhood losses, eqs. 1–7),
`sampling` (neighbourhood sampling), `pipeline` (a retrieval row), `export`, `cca` (the CCA
baseline). The region–phrase model of Algorithm 1 (phrase localization, Table 1): the
`region_phrase_*` modules (losses, sampling, pipeline, export, figures).
"""
