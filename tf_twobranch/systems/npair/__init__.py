"""Semi-supervised phrase localization by N-pair retrieval (Das et al.).

`model` (the joint space of backbone maps and words), `heat_map_volume` (the localization volume
m_{r,c,t} and its scores, S_MaxImage), `losses` (N-pair and hardest-negative triplet), `sampling`,
`features`, `pipeline` (a row), `export`, `heat_maps` (word/phrase heat maps and the pointing
game on them), `retrieval` (gallery scoring) and `heat_map_figures`.
"""
