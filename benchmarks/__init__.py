# First, so that the package's TensorFlow defaults (tf_twobranch/__init__.py) are
# in place before any benchmark imports keras or tensorflow.
import tf_twobranch  # noqa: F401
