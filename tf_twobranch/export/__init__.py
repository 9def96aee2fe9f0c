"""SavedModel plumbing for TF Serving (see docs/SERVING.md); each system's export lives in its folder.

* `serving`: input specs, Keras-variable tracking, in-graph validation, batch image decoding, warm-up files.
* `saved_model`: the tower-pair signature base, the atomic save with run config and warm-up file, the warm-up JPEG.
* `retrieval_signatures`: the `RetrievalGallery` and the ``retrieve_*`` signatures every system's export adds.
* `run_gallery`: `RunExport`, what a system's export of a run gives the app `tf_twobranch.run_export`
  (`export_run`, `gallery_from_model`), and the gallery files' readers.

The systems' exports: `systems.two_branch.export` (`export_saved_model`),
`systems.two_branch.region_phrase_export` (`export_region_phrase_model`),
`systems.dual_path.export` (`export_dual_path`), `systems.fragments.export`
(`export_fragment_model`), `systems.npair.export` (`export_npair_model`).
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

__all__ = [
    "save_module_atomically",
    "TowerServingModule",
    "warmup_jpeg",
    "decode_jpeg_batch",
    "track_keras_variables",
    "WARMUP_FILENAME",
    "read_warmup_requests",
    "write_warmup_requests",
    "run_warmup_requests",
]
