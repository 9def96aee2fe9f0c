"""Deep fragment embeddings (Karpathy, Joulin, Fei-Fei).

`model` (image and sentence fragment towers, MIL alignment and global ranking), `losses`
(eqs. 4–7), `sentence_fragments` (dependency-relation triplets), `image_fragments` and `features`
(object fragments and cached inputs), `sampling` (its batches), `pipeline` (a row), `export`,
`retrieval` (S_kl scoring) and `alignment` (the fragment alignment pictures' data).
"""
