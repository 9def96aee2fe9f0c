"""tf_twobranch: image-text matching networks in TensorFlow/Keras 3."""
__version__ = "0.1.0"
