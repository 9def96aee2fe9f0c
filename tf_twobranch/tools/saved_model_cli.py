"""TensorFlow's ``saved_model_cli`` with the tensorflow-text ops registered and ``run`` inputs checked.

Plain ``saved_model_cli run`` cannot load graphs with in-graph tokenization
(``Op type not registered``): this tool imports ``tensorflow_text`` first,
then runs TensorFlow's ``saved_model_cli`` with the same arguments::

    python -m tf_twobranch.tools.saved_model_cli run --dir D --tag_set serve \\
        --signature_def embed_texts --input_exprs 'captions=["a dog runs"]' --outdir /tmp/out

Before ``run`` feeds its inputs, each is checked against the signature's
input spec (`tf_twobranch.export.serving.check_signature_inputs`): a wrong
dtype (float64 features, decoded uint8 pixels for ``image_jpeg``), a missing
or unknown input is one ``error:`` line naming the input and what it takes,
and exit status 2, instead of a conversion error from deep in the session.
See docs/SERVING.md.
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import tensorflow_text
from tensorflow.python.tools import saved_model_cli

from tf_twobranch.cli import exit_with_user_error
from tf_twobranch.errors import UserInputError
from tf_twobranch.export.serving import check_signature_inputs, signature_input_specs

__all__ = ["run_saved_model_cli"]

# Imported for its side effect: it registers the tensorflow-text ops that graphs with in-graph
# tokenization need (the name is kept so that the import reads as used).
_TEXT_OPS = tensorflow_text

_run_with_feed_dict = saved_model_cli.run_saved_model_with_feed_dict


def _checked_run_with_feed_dict(saved_model_dir, tag_set, signature_def_key, feed_dict, *args, **kwargs):
    signature = saved_model_cli.get_signature_def_map(saved_model_dir, tag_set).get(signature_def_key)
    if signature is not None:   # an unknown signature: saved_model_cli's own message lists them
        tensors = check_signature_inputs(signature_input_specs(signature), feed_dict, signature_def_key)
        feed_dict = {name: np.asarray(tensor.numpy()) for name, tensor in tensors.items()}
    return _run_with_feed_dict(saved_model_dir, tag_set, signature_def_key, feed_dict, *args, **kwargs)


def run_saved_model_cli(argv: Sequence[str]) -> None:
    """Runs TensorFlow's ``saved_model_cli`` with `argv` after ``import tensorflow_text``;
    ``run`` checks its inputs against the signature first."""
    sys.argv = ["saved_model_cli", *argv]
    saved_model_cli.run_saved_model_with_feed_dict = _checked_run_with_feed_dict
    try:
        saved_model_cli.main()
    except UserInputError as err:
        exit_with_user_error(err)
    finally:
        saved_model_cli.run_saved_model_with_feed_dict = _run_with_feed_dict


if __name__ == "__main__":
    run_saved_model_cli(sys.argv[1:])
