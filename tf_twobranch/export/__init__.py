"""SavedModel exports for TF Serving (see docs/SERVING.md), one module per model family.

* `serving`: input specs, Keras-variable tracking, in-graph validation, batch image decoding, warm-up files.
* `saved_model`: the tower-pair signature base, the atomic save with run config and warm-up file, the warm-up JPEG.
* `two_branch`: image–sentence two-branch models (`export_saved_model`).
* `dual_path`: the dual-path CNN of the instance loss (`export_dual_path`).
* `localization`: region–phrase scoring from image bytes, boxes and phrases (`export_region_phrase_model`).
* `fragment_embedding`: deep fragment embeddings: fragment towers, S_kl and the alignment matrix (`export_fragment_model`).
* `npair_localization`: Das et al.: JPEG + raw caption → score, per-token heat maps, arg-max points (`export_npair_model`).
* `retrieval_signatures`: the `RetrievalGallery` and the ``retrieve_*`` signatures every family's export adds.
* `retrieval`: `gallery_from_model`, the gallery a model of any family embeds (above the family exports).

``saved_model_cli`` with the tensorflow-text ops registered is the command-line
tool `tf_twobranch.tools.saved_model_cli`.
"""
from tf_twobranch.export.serving import (
    WARMUP_FILENAME,
    decode_jpeg_batch,
    read_warmup_requests,
    run_warmup_requests,
    track_keras_variables,
    write_warmup_requests,
)
from tf_twobranch.export.saved_model import TowerServingModule, save_module_atomically, warmup_jpeg
from tf_twobranch.export.two_branch import TwoBranchServingModule, export_saved_model
from tf_twobranch.export.dual_path import DualPathServingModule, embed_with_keras, export_dual_path
from tf_twobranch.export.fragment_embedding import FragmentServingModule, export_fragment_model
from tf_twobranch.export.npair_localization import NPairServingModule, export_npair_model
from tf_twobranch.export.localization import (
    BOX_CONVENTIONS,
    RegionPhraseServingModule,
    crop_regions,
    decode_image_exact,
    export_region_phrase_model,
)

__all__ = [
    "export_saved_model",
    "export_dual_path",
    "export_region_phrase_model",
    "export_fragment_model",
    "export_npair_model",
    "save_module_atomically",
    "TowerServingModule",
    "TwoBranchServingModule",
    "DualPathServingModule",
    "RegionPhraseServingModule",
    "FragmentServingModule",
    "NPairServingModule",
    "embed_with_keras",
    "warmup_jpeg",
    "BOX_CONVENTIONS",
    "crop_regions",
    "decode_image_exact",
    "decode_jpeg_batch",
    "track_keras_variables",
    "WARMUP_FILENAME",
    "read_warmup_requests",
    "write_warmup_requests",
    "run_warmup_requests",
]
