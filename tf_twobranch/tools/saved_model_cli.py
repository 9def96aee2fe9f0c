"""TensorFlow's ``saved_model_cli`` with the tensorflow-text ops registered.

Plain ``saved_model_cli run`` cannot load graphs with in-graph tokenization
(``Op type not registered``): this tool imports ``tensorflow_text`` first,
then runs TensorFlow's ``saved_model_cli`` unchanged, with the same
arguments::

    python -m tf_twobranch.tools.saved_model_cli run --dir D --tag_set serve \\
        --signature_def embed_texts --input_exprs 'captions=["a dog runs"]' --outdir /tmp/out

See docs/SERVING.md.
"""
from __future__ import annotations

import sys
from typing import Sequence

import tensorflow_text
from tensorflow.python.tools import saved_model_cli

__all__ = ["run_saved_model_cli"]

# Imported for its side effect: it registers the tensorflow-text ops that graphs with in-graph
# tokenization need (the name is kept so that the import reads as used).
_TEXT_OPS = tensorflow_text


def run_saved_model_cli(argv: Sequence[str]) -> None:
    """Runs TensorFlow's ``saved_model_cli`` with `argv` after ``import tensorflow_text``."""
    sys.argv = ["saved_model_cli", *argv]
    saved_model_cli.main()


if __name__ == "__main__":
    run_saved_model_cli(sys.argv[1:])
