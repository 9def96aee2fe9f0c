"""Two-branch models: build, train, evaluate via the shared core, save/load."""
import json

import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.json_files import write_json
from tf_twobranch.runs import load_run
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
from tf_twobranch.systems.two_branch import sampling as S
from tf_twobranch.training import trainer


def synthetic(num_images=60, caps=5, dim_i=12, dim_t=10, seed=0):
    """Images and captions as noisy linear views of a shared latent."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(num_images, 6))
    img = z @ rng.normal(size=(6, dim_i)) + 0.1 * rng.normal(size=(num_images, dim_i))
    zc = np.repeat(z, caps, 0) + 0.3 * rng.normal(size=(num_images * caps, 6))
    txt = zc @ rng.normal(size=(6, dim_t))
    return img.astype(np.float32), txt.astype(np.float32), np.repeat(np.arange(num_images), caps)


def tiny_config(**kw):
    base = dict(image_dim=12, text_dim=10, image_hidden=(32,), text_hidden=(32,), embed_dim=8,
                top_k=3, dropout=0.0)
    base.update(kw)
    return TwoBranchConfig(**base)


def test_config_round_trip_and_validation():
    cfg = tiny_config(layout="paper")
    assert TwoBranchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="layout"):
        tiny_config(layout="fancy")
    with pytest.raises(ConfigError, match="unknown two-branch model configuration keys"):
        TwoBranchConfig.from_dict({"imag_dim": 3})


@pytest.mark.parametrize("layout,hidden", [("original", (32,)), ("paper", (32,)),
                                           ("original", ())])
def test_towers_output_unit_vectors(layout, hidden):
    model = build_model(tiny_config(layout=layout, image_hidden=hidden, text_hidden=hidden))
    emb = model.embed_images(np.random.rand(5, 12).astype(np.float32))
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    names = [l.name for l in model.image_tower.layers]
    if layout == "original" and hidden:
        assert names.index("image_bn1") < names.index("image_relu1")
        assert not any(n.startswith("image_bn2") for n in names)
    if layout == "paper" and hidden:
        assert "image_bn2" in names


def test_embedding_network_learns_and_evaluate_matches_core(tmp_path):
    img, txt, cap_img = synthetic()
    model = build_model(tiny_config())
    before = model.evaluate({"image": img, "text": txt, "caption_image": cap_img})
    ds = S.attach_features(S.image_sentence_batches(cap_img, 60, batch_size=20, seed=0),
                           img, txt)
    cfg = trainer.TrainConfig(epochs=8, learning_rate=3e-3, verbose=0)
    trainer.train(model, ds, cfg, tmp_path, steps_per_epoch=15)
    after = model.evaluate({"image": img, "text": txt, "caption_image": cap_img})
    assert after["t2i_r1"] > before["t2i_r1"] + 10
    core = retrieval.retrieval_metrics(model.embed_images(img), model.embed_texts(txt), cap_img)
    assert after == core
    # rebuild from the run directory alone
    write_json(tmp_path / "run_config.json", {"model": model.config.to_dict()})
    restored = load_run(tmp_path).model
    np.testing.assert_allclose(restored.embed_texts(txt), model.embed_texts(txt), atol=1e-6)
    assert (tmp_path / "checkpoints" / "epoch_0008.weights.h5").exists()


def test_similarity_network_trains_on_balanced_pairs(tmp_path):
    img, txt, cap_img = synthetic()
    model = build_model(tiny_config(kind="similarity", similarity_head=(16, 8)))
    ds = S.attach_features(S.similarity_pair_batches(cap_img, 60, batch_size=30), img, txt)
    hist = trainer.train(model, ds, trainer.TrainConfig(epochs=4, learning_rate=3e-3, verbose=0),
                         tmp_path, steps_per_epoch=10)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    m = model.evaluate({"image": img, "text": txt, "caption_image": cap_img})
    i2t, t2i = retrieval.ranks_from_score_fn(
        model.score_fn(model.embed_images(img), model.embed_texts(txt)), 60, cap_img)
    assert m == retrieval.retrieval_metrics_from_ranks(i2t, t2i)


def test_lstm_text_tower_accepts_strings():
    from tf_twobranch.systems.two_branch.text_towers import build_string_text_tower
    vocab = ["<pad>", "<unk>", "a", "red", "seven", "blue"]
    model = build_model(tiny_config(text_encoder="lstm", vocabulary=vocab, max_len=6,
                                    word_dim=4, lstm_units=5))
    tower = build_string_text_tower(model.text_tower, vocab, 6)
    out = tower(tf.constant(["A red seven", "a blue zebra", ""]))
    assert out.shape == (3, 8)
    ids = tower.get_layer("caption_tokenizer")(tf.constant(["A red seven!"])).numpy()
    np.testing.assert_array_equal(ids[0], [2, 3, 4, 0, 0, 0])


def test_evaluate_rejects_missing_data():
    model = build_model(tiny_config())
    with pytest.raises(UserInputError, match="caption_image"):
        model.evaluate({"image": np.zeros((2, 12)), "text": np.zeros((2, 10))})


def test_xla_optimizer_update_matches_plain_update():
    import keras
    img, txt, cap_img = synthetic(num_images=20)
    labels = np.repeat(np.eye(20, dtype=bool), 5, axis=0)
    batch = {"image": tf.constant(img), "text": tf.constant(txt), "labels": tf.constant(labels)}
    weights = []
    for xla in (False, True):
        keras.utils.set_random_seed(0)
        model = build_model(tiny_config())
        model.compile(keras.optimizers.Adam(1e-2), xla_optimizer_update=xla)
        assert (model._xla_apply is not None) == xla
        for _ in range(3):
            model.train_on_batch(batch)
        weights.append([w.numpy() for w in model.trainable_variables])
    # Biases feeding batch norm have ~0 true gradient; Adam turns their float
    # noise into steps of up to lr, so compare at a fraction of the 3·lr range.
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_one_replica_mirrored_strategy_trains_without_the_xla_update():
    # One GPU under --strategy=mirrored is one replica, but its optimizer update is still a
    # cross-replica merge_call, which cannot run inside the nested XLA function (first GPU session).
    import keras
    img, txt, _ = synthetic(num_images=20)
    labels = np.repeat(np.eye(20, dtype=bool), 5, axis=0)
    data = tf.data.Dataset.from_tensors({"image": img, "text": txt, "labels": labels}).repeat(2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        model = build_model(tiny_config())
        model.compile(keras.optimizers.Adam(1e-2))
    assert model._xla_apply is None
    history = model.fit(data, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][-1])
    default = build_model(tiny_config())
    default.compile(keras.optimizers.Adam(1e-2))
    assert default._xla_apply is not None   # outside any strategy the fused update stays on


def test_run_dir_backup_of_another_configuration_is_discarded(tmp_path):
    (tmp_path / "backup").mkdir()
    write_json(tmp_path / "run_config.json", {"model": {"margin": 0.05}})
    trainer.prepare_run_dir(tmp_path, {"model": {"margin": 0.05}})
    assert (tmp_path / "backup").exists()          # same run: resume from it
    trainer.prepare_run_dir(tmp_path, {"model": {"margin": 0.2}})
    assert not (tmp_path / "backup").exists()      # other run: never restored
    assert json.loads((tmp_path / "run_config.json").read_text())["model"]["margin"] == 0.2


def test_embedding_traces_each_tower_once(caplog):
    """Embedding again (evaluate calls it per split) reuses the traced graph: no retracing."""
    from tf_twobranch.batching import inference_function
    model = build_model(tiny_config())
    rng = np.random.default_rng(0)
    for _ in range(3):
        model.embed_images(rng.standard_normal((10, 12)).astype(np.float32), batch_size=4)
        model.embed_texts(rng.standard_normal((10, 10)).astype(np.float32), batch_size=4)
    for tower in (model.image_tower, model.text_tower):
        # Full batches of 4 and the last batch of 2: at most two traces, once.
        assert inference_function(tower).experimental_get_tracing_count() <= 2
    assert "retracing" not in caplog.text


def test_evaluate_refuses_arguments_that_do_not_apply_and_keeps_the_protocol(monkeypatch):
    """The similarity network's scores go through the protocol's folds like the embedding network's."""
    img, txt, cap_img = synthetic(num_images=40)
    split = {"image": img, "text": txt, "caption_image": cap_img}
    # coco_1k's folds, scaled to this test: 4 folds of 10 images.
    monkeypatch.setitem(retrieval.PROTOCOLS, "coco_1k", retrieval.Protocol("coco_1k", 10, 4))
    for kind in ("embedding", "similarity"):
        model = build_model(tiny_config(kind=kind))
        with pytest.raises(UserInputError, match="does not take"):
            model.evaluate(split, flip_average=True)
        image_embeds, text_embeds = model.embed_images(img), model.embed_texts(txt)
        folds = []
        for f in range(4):
            sel = (cap_img >= 10 * f) & (cap_img < 10 * (f + 1))
            if kind == "embedding":
                folds.append(retrieval.retrieval_metrics(image_embeds[10 * f:10 * (f + 1)],
                                                         text_embeds[sel], cap_img[sel] - 10 * f))
            else:
                i2t, t2i = retrieval.ranks_from_score_fn(
                    model.score_fn(image_embeds[10 * f:10 * (f + 1)], text_embeds[sel]), 10,
                    cap_img[sel] - 10 * f)
                folds.append(retrieval.retrieval_metrics_from_ranks(i2t, t2i))
        want = {k: np.mean([m[k] for m in folds]) for k in folds[0]}
        got = model.evaluate(split, protocol="coco_1k")
        assert {k: got[k] for k in want} == pytest.approx(want)
        assert got["num_folds"] == 4 and got["rsum_fold_std"] == pytest.approx(
            np.std([m["rsum"] for m in folds]))
        assert model.evaluate(split) != pytest.approx(want)  # the folds are not the whole set


def test_load_run_names_what_a_run_folder_holds(tmp_path):
    with pytest.raises(UserInputError, match="does not exist"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(UserInputError, match="run_config.json .* dual_path_config.json"):
        load_run(tmp_path)
    write_json(tmp_path / "run_config.json", {"model": tiny_config().to_dict()})
    with pytest.raises(UserInputError, match="checkpoint not found"):
        load_run(tmp_path)
