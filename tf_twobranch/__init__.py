"""tf_twobranch: image-text matching networks in TensorFlow/Keras 3."""
import os as _os

# TensorFlow switches its oneDNN CPU kernels on by itself only on CPUs with
# AVX-512 VNNI/BF16 or AMX. On AVX2-only machines they are still much faster
# for this package's work (measured: scene-CNN training 1.4x, its inference
# 2x, float32 matmuls 1.3x; BUILD_NOTES "Main job time"), so they are the
# default here. This must happen before TensorFlow is first imported; a value
# already in the environment (e.g. TF_ENABLE_ONEDNN_OPTS=0) wins.
_os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

__version__ = "0.1.0"
