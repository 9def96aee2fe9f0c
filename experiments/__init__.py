# First, so that the package's TensorFlow defaults (tf_twobranch/__init__.py) are
# in place before keras or tensorflow is imported by any experiment.
import tf_twobranch  # noqa: F401
