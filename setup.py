"""Installable package for tf_twobranch."""
from setuptools import find_packages, setup

setup(
    name="tf_twobranch",
    version="0.1.0",
    description=(
        "Two-branch image-text matching networks (embedding and similarity "
        "networks, dual-path CNN with instance loss, fragment embeddings) in "
        "TensorFlow/Keras 3"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["tf_twobranch", "tf_twobranch.*", "experiments", "experiments.*"]),
    package_data={"experiments": ["configs/*.cfg"]},
    install_requires=[
        "tensorflow>=2.18,<2.22",
        "tensorflow-text>=2.18,<2.22",
        "tensorboard>=2.18,<3",
        "keras>=3.6,<4",
        "numpy>=1.26,<3",
        "scikit-learn>=1.5,<2",
        "threadpoolctl>=3.1,<4",
        "scipy>=1.11,<2",
        "absl-py>=2.1,<3",
        "h5py>=3.10,<4",
        "pillow>=10,<14",
        "matplotlib>=3.8,<4",
    ],
    # spaCy only (never a spaCy model): `parse` for --parser=spacy, `test` to build Docs by hand.
    # tensorflow-serving-api (the real PredictRequest / PredictionLog protos) is a client concern,
    # so only `test` has it; its range is tensorflow's, so it never moves tensorflow.
    extras_require={
        "parse": ["spacy>=3.7,<4"],
        # A Linux machine with an NVIDIA GPU: TensorFlow's CUDA and cuDNN libraries from PyPI.
        "gpu": ["tensorflow[and-cuda]>=2.18,<2.22"],
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "spacy>=3.7,<4",
                 "tensorflow-serving-api>=2.18,<2.22"],
    },
)
