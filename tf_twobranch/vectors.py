"""Row-wise L2 normalisation of NumPy embeddings (the one copy; graphs use `tf.math.l2_normalize`)."""
from __future__ import annotations

import numpy as np

__all__ = ["l2_normalize_rows"]

# float32 squares overflow above ~1.8e19; rows that large (a randomly
# initialised backbone's features) are scaled by their largest entry first.
_OVERFLOW_SAFE_ABOVE = 1e18


def l2_normalize_rows(x, dtype=np.float32, epsilon: float = 1e-12) -> np.ndarray:
    """`x / max(||x||, epsilon)` per row, computed in `dtype` (None: x's own).

    All-zero rows stay zero. Rows of ordinary size are divided directly (the
    same bits as the plain formula); only huge rows take the scaled path.
    """
    x = np.asarray(x) if dtype is None else np.asarray(x, dtype)
    if x.size and float(np.max(np.abs(x))) > _OVERFLOW_SAFE_ABOVE:
        scale = np.maximum(np.max(np.abs(x), axis=1, keepdims=True), np.asarray(1e-30, x.dtype))
        x = x / scale
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), epsilon)
