"""What every SavedModel export shares: the tower-pair signature set, the
atomic save (with ``assets.extra/run_config.json`` and the TF Serving warm-up
file) and the warm-up JPEG.
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Mapping, Sequence

import tensorflow as tf

from tf_twobranch.export import serving

__all__ = ["TowerServingModule", "save_module_atomically", "warmup_jpeg"]


def warmup_jpeg(height: int, width: int) -> bytes:
    """A small grey JPEG: a real, decodable image for warm-up requests."""
    return tf.io.encode_jpeg(tf.fill([height, width, 3], tf.constant(128, tf.uint8))).numpy()


class TowerServingModule(tf.Module):
    """Base of the image–text exports: the four signatures every tower pair serves."""

    def signatures(self) -> dict:
        return {"serving_default": self.score, "score": self.score,
                "embed_images": self.embed_images, "embed_texts": self.embed_texts}


def save_module_atomically(module: tf.Module, export_dir, run_config: dict, *, overwrite: bool = True,
                           warmup_requests: Sequence[tuple[str, Mapping[str, object]]] | None = None,
                           model_name: str = "") -> pathlib.Path:
    """Writes `module` with its signatures, `assets.extra/run_config.json` and the warm-up file.

    `module.signatures()` gives the signatures. Warm-up requests (default:
    ``module.warmup_requests()`` when the module has that method) are run
    through the signatures first — TF Serving refuses a model whose warm-up
    fails — then written with `tf_twobranch.export.serving.write_warmup_requests`.
    The SavedModel is written next to `export_dir` and renamed into place,
    so a reader (or TF Serving polling the folder) never sees a half-written one.
    """
    export_dir = pathlib.Path(export_dir)
    if export_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{export_dir} exists")
        shutil.rmtree(export_dir)
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    signatures = module.signatures()
    if warmup_requests is None and hasattr(module, "warmup_requests"):
        warmup_requests = module.warmup_requests()
    if warmup_requests:
        serving.run_warmup_requests(signatures, warmup_requests)
    tf.saved_model.save(module, str(tmp), signatures=signatures)
    extra = tmp / "assets.extra"
    extra.mkdir(exist_ok=True)
    (extra / "run_config.json").write_text(
        json.dumps(run_config, indent=2, sort_keys=True, default=str), encoding="utf-8")
    if warmup_requests:
        serving.write_warmup_requests(tmp, warmup_requests, model_name=model_name)
    tmp.rename(export_dir)
    return export_dir
