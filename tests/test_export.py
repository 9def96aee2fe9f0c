"""SavedModel export: towers and scoring, raw strings for the LSTM branch."""
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.export import export_saved_model
from tf_twobranch.models.two_branch import TwoBranchConfig, build_model


def _cfg(**kw):
    base = dict(image_dim=6, text_dim=5, image_hidden=(8,), text_hidden=(8,), embed_dim=4,
                dropout=0.0)
    base.update(kw)
    return TwoBranchConfig(**base)


def test_feature_towers_round_trip(tmp_path):
    model = build_model(_cfg())
    path = export_saved_model(model, tmp_path / "export")
    loaded = tf.saved_model.load(str(path))
    img = np.random.rand(3, 6).astype(np.float32)
    txt = np.random.rand(4, 5).astype(np.float32)
    np.testing.assert_allclose(loaded.signatures["embed_images"](image_features=img)["image_embedding"],
                               model.embed_images(img), atol=1e-6)
    scores = loaded.signatures["score"](image_features=img, text_features=txt)["scores"].numpy()
    np.testing.assert_allclose(scores, model.embed_images(img) @ model.embed_texts(txt).T, atol=1e-5)
    cfg = json.loads((path / "assets.extra" / "run_config.json").read_text())
    assert cfg["model"]["image_dim"] == 6
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN or inf"):
        bad = img.copy(); bad[0, 0] = np.nan
        loaded.signatures["embed_images"](image_features=bad)


def test_similarity_network_scores(tmp_path):
    model = build_model(_cfg(kind="similarity", similarity_head=(8,)))
    loaded = tf.saved_model.load(str(export_saved_model(model, tmp_path / "e")))
    img = np.random.rand(2, 6).astype(np.float32)
    txt = np.random.rand(3, 5).astype(np.float32)
    scores = loaded.score(img, txt)["scores"].numpy()
    expected = model.score_fn(model.embed_images(img), model.embed_texts(txt))(0, 3)
    np.testing.assert_allclose(scores, expected, atol=1e-5)


def test_lstm_tower_takes_raw_strings_and_saved_model_cli(tmp_path):
    vocab = ["<pad>", "<unk>", "a", "red", "seven"]
    model = build_model(_cfg(text_encoder="lstm", vocabulary=vocab, max_len=4, word_dim=3,
                             lstm_units=4))
    path = export_saved_model(model, tmp_path / "export")
    loaded = tf.saved_model.load(str(path))
    out = loaded.signatures["embed_texts"](captions=tf.constant(["a red seven", "A RED seven!"]))
    emb = out["text_embedding"].numpy()
    np.testing.assert_allclose(emb[0], emb[1], atol=1e-6)  # same tokens after normalisation
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-empty"):
        loaded.signatures["embed_texts"](captions=tf.constant(["a red seven", "  "]))
    show = subprocess.run([sys.executable, "-m", "tensorflow.python.tools.saved_model_cli", "show",
                           "--dir", str(path), "--all"], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    assert "embed_texts" in show.stdout and "captions" in show.stdout
