"""Loading a Keras ``.weights.h5`` checkpoint into a built model, with errors that name the file.

Every run-folder loader (`tf_twobranch.runs.load_run`, the experiments'
``load_row`` and ``--init_from``, the trainer's restore, the dual path's
`load_dual_path_model`) and so every draw tool reads checkpoints through
`load_checkpoint`, which refuses, as a `DataFormatError` naming the file:

* a missing file;
* a file h5py cannot open: truncated (a copy or a run cut short) or not
  HDF5 at all — h5py's own ``OSError`` would otherwise surface raw;
* weights that do not fit the model (another architecture or size);
* non-finite weights (NaN or inf), naming the first variable that has them:
  such a file loads without complaint and only fails much later, in
  whichever computation first meets the NaN.
"""
from __future__ import annotations

import os
import pathlib

import h5py
import numpy as np

from tf_twobranch.errors import DataFormatError

__all__ = ["load_checkpoint"]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_checkpoint(model, path, *, expected: str = "") -> pathlib.Path:
    """Loads `path` (a ``.weights.h5`` file) into `model`; returns the path.

    Args:
      model: a built Keras model (or layer) of the checkpoint's architecture.
      path: the weights file.
      expected: what the checkpoint must be, added to a mismatch message
        (e.g. "the same architecture and number of classes (31)").

    Raises:
      DataFormatError: the file is missing, unreadable, does not fit
        `model`, or holds NaN/inf weights (the variable is named).
    """
    path = pathlib.Path(os.fspath(path))
    if not path.is_file():
        raise DataFormatError(path, "checkpoint file does not exist")
    try:
        with h5py.File(path, "r"):
            pass
    except OSError as err:
        raise DataFormatError(path, f"unreadable checkpoint: not a complete HDF5 file (h5py: "
                              f"{_first_line(err)}); expected a .weights.h5 file written by Keras — "
                              "a truncated copy or a run cut short while saving") from None
    try:
        model.load_weights(path)
    except (ValueError, OSError, KeyError, TypeError) as err:
        hint = f"; the checkpoint must come from {expected}" if expected else ""
        raise DataFormatError(path, f"weights do not fit this model ({_first_line(err)}){hint}") from None
    for variable in model.weights:
        values = np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable)
        if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
            bad = int(np.size(values) - np.count_nonzero(np.isfinite(values)))
            raise DataFormatError(path, f"non-finite weights: {bad} of {values.size} values of "
                                  f"{values.shape} are NaN or inf; expected finite weights (the run "
                                  "diverged before this checkpoint was written, or the file was "
                                  "altered)", record=variable.path)
    return path
