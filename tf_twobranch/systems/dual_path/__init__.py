"""The dual-path CNN with the instance loss (Zheng et al.).

`model` (the two CNN paths, Stage I and Stage II), `losses` (instance and ranking losses), `data`
(the token rows and images of its datasets), `sampling` (its batches), `pipeline` (a row),
`export`, `separability` (the similarity histograms and S of its Fig. 5).
"""
