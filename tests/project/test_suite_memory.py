"""The suite's own processes give TensorFlow's memory back (tests/conftest.py)."""
import gc
import os

import numpy as np

from tf_twobranch.memory import status_kib


def _anonymous_bytes() -> int:
    return status_kib("self", ("RssAnon",))["RssAnon"] * 1024


def test_a_large_tensor_is_given_back_after_use():
    # With oneDNN's pooled allocator this process would keep the 400 MB product for good, and a
    # worker keeps the high-water mark of every file it runs (the suite's tree reached 8.9 GB).
    import tensorflow as tf

    a = np.ones((4000, 8), np.float32)
    b = np.ones((25000, 8), np.float32)
    tf.matmul(a[:4], b[:4], transpose_b=True)    # the kernels and thread pools are not the point
    gc.collect()
    before = _anonymous_bytes()
    for _ in range(2):
        product = tf.matmul(a, b, transpose_b=True)   # 4000 x 25000 float32: 400 MB
        assert float(product[0, 0]) == 8.0
        del product
        gc.collect()
    kept = _anonymous_bytes() - before
    assert kept < 100 * 2**20, (f"{kept / 2**20:.0f} MiB kept after a 400 MB product was freed "
                                f"(TF_ONEDNN_USE_SYSTEM_ALLOCATOR={os.environ.get('TF_ONEDNN_USE_SYSTEM_ALLOCATOR')})")
