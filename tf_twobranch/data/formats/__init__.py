"""Readers and writers for caption, split and feature files (one module per format).

Every reader returns a `tf_twobranch.data.corpus.CaptionCorpus` (or, for
features, float32 numpy arrays) and reports bad input as
`tf_twobranch.errors.DataFormatError` naming the file and line/record.
Importing this package does not import TensorFlow.
"""
from tf_twobranch.data.formats.coco_captions import (CocoCaptionCorpus, read_coco_captions,
                                                     write_coco_captions)
from tf_twobranch.data.formats.cuhk_pedes import PedesSplit, read_cuhk_pedes, write_cuhk_pedes
from tf_twobranch.data.formats.features import (load_feature_matrix, load_paired_features,
                                                save_feature_matrix)
from tf_twobranch.data.formats.flickr30k_tokens import read_token_file, write_token_file
from tf_twobranch.data.formats.karpathy_json import read_karpathy_json, write_karpathy_json
from tf_twobranch.data.formats.precomp import read_precomp_corpus, read_precomp_split
from tf_twobranch.data.formats.splits import read_split_file, write_split_file

__all__ = [
    "CocoCaptionCorpus", "read_coco_captions", "write_coco_captions",
    "PedesSplit", "read_cuhk_pedes", "write_cuhk_pedes",
    "load_feature_matrix", "load_paired_features", "save_feature_matrix",
    "read_token_file", "write_token_file",
    "read_karpathy_json", "write_karpathy_json",
    "read_precomp_corpus", "read_precomp_split",
    "read_split_file", "write_split_file",
]
