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
A request the graph's own checks refuse (an empty caption, a sentence with
no fragment the model knows, a box outside the image) is one ``error:``
line with the check's message, exit status 2, not a traceback. Words the
export drops as outside its vocabulary (N-pair captions, fragment parse
triplets) are named on one ``note:`` line. See docs/SERVING.md.
"""
from __future__ import annotations

import json
import pathlib
import sys
from typing import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_text
from tensorflow.python.tools import saved_model_cli

from tf_twobranch.cli import exit_with_user_error
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import UserInputError
from tf_twobranch.export.serving import check_signature_inputs, signature_input_specs

__all__ = ["run_saved_model_cli"]

# Imported for its side effect: it registers the tensorflow-text ops that graphs with in-graph
# tokenization need (the name is kept so that the import reads as used).
_TEXT_OPS = tensorflow_text

_run_with_feed_dict = saved_model_cli.run_saved_model_with_feed_dict


def _graph_message(err: tf.errors.OpError) -> str:
    """The first line of a graph error (the assertion's text), without the node and stack lines."""
    boilerplate = ("graph execution error", "detected at node", "<stack traces unavailable>", "[[",
                   "original stack trace", "during handling")
    lines = [line.strip() for line in str(err.message).splitlines()]
    lines = [line for line in lines if line and not line.lower().startswith(boilerplate)]
    assertions = [line for line in lines if line.startswith("assertion failed")]
    return (assertions or lines or [type(err).__name__])[0]


def _unknown_words(saved_model_dir, feed_dict) -> list[str]:
    """Words of the request that the export drops as outside its vocabulary (the N-pair
    ``caption`` input, the fragment ``word1`` / ``word2`` parse triplets), from the vocabulary
    in ``assets.extra/run_config.json``; [] when the export records none."""
    path = pathlib.Path(saved_model_dir) / "assets.extra" / "run_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if "caption" in feed_dict and "vocabulary" in config.get("npair_export", {}):
        vocabulary = set(config["npair_export"]["vocabulary"])
        words = [w for c in np.asarray(feed_dict["caption"], dtype=object).reshape(-1)
                 for w in tokenize_caption(c.decode("utf-8", "replace") if isinstance(c, bytes) else str(c))]
    elif {"word1", "word2"} <= set(feed_dict) and "words" in config.get("fragment_export", {}):
        vocabulary = set(config["fragment_export"]["words"])
        words = [(w.decode("utf-8", "replace") if isinstance(w, bytes) else str(w)).strip().lower()
                 for name in ("word1", "word2") for w in np.asarray(feed_dict[name], dtype=object).reshape(-1)]
    else:
        return []
    return sorted({w for w in words if w and w not in vocabulary})


def _checked_run_with_feed_dict(saved_model_dir, tag_set, signature_def_key, feed_dict, *args, **kwargs):
    signature = saved_model_cli.get_signature_def_map(saved_model_dir, tag_set).get(signature_def_key)
    if signature is not None:   # an unknown signature: saved_model_cli's own message lists them
        tensors = check_signature_inputs(signature_input_specs(signature), feed_dict, signature_def_key)
        feed_dict = {name: np.asarray(tensor.numpy()) for name, tensor in tensors.items()}
    unknown = _unknown_words(saved_model_dir, feed_dict)
    if unknown:
        print(f"note: not in the model's vocabulary, dropped: {', '.join(unknown[:20])}"
              f"{', ...' if len(unknown) > 20 else ''} (docs/SERVING.md)", file=sys.stderr)
    try:
        return _run_with_feed_dict(saved_model_dir, tag_set, signature_def_key, feed_dict, *args, **kwargs)
    except tf.errors.InvalidArgumentError as err:
        # The graph's own checks (docs/SERVING.md, "Errors"): one line, not a traceback.
        raise UserInputError(f"signature {signature_def_key!r} refused the request (InvalidArgumentError): "
                             f"{_graph_message(err)}") from None


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
