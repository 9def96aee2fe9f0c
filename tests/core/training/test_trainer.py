"""Trainer: exact-step resume, NaN guard, atomic checkpoints (in-process, tiny)."""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
from tf_twobranch.training import trainer

STEPS = 4


def tiny_model():
    keras.utils.set_random_seed(0)
    return build_model(TwoBranchConfig(image_dim=6, text_dim=5, image_hidden=(8,),
                                       text_hidden=(8,), embed_dim=4, dropout=0.3, top_k=2))


def tiny_dataset(nan_from_step=None):
    """Element i is a deterministic function of i; NaN image features from `nan_from_step`."""
    def batch(step):
        seed = tf.stack([tf.constant(1, tf.int64), step])
        image = tf.random.stateless_normal([4, 6], seed=seed)
        text = tf.random.stateless_normal([8, 5], seed=seed + 1)
        if nan_from_step is not None:
            image = tf.where(step >= nan_from_step, image * np.nan, image)
        labels = tf.equal(tf.range(8)[:, None] // 2, tf.range(4)[None, :])
        return {"image": image, "text": text, "labels": labels}
    return tf.data.Dataset.counter().map(batch)


class Interrupt(Exception):
    pass


class InterruptAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise Interrupt()


def weights_of(model):
    return [v.numpy() for v in model.weights] + [model.optimizer.iterations.numpy()]


def cfg(**kw):
    return trainer.TrainConfig(epochs=3, learning_rate=1e-2, verbose=0, **kw)


def test_mid_epoch_resume_continues_at_the_exact_step(tmp_path):
    straight = tiny_model()
    h_straight = trainer.train(straight, tiny_dataset(), cfg(backup_every_steps=2),
                               tmp_path / "a", steps_per_epoch=STEPS)
    interrupted = tiny_model()
    with pytest.raises(Interrupt):
        # killed after batch index 2 of epoch 2: the last backup is after batch 2 of 4
        trainer.train(interrupted, tiny_dataset(), cfg(backup_every_steps=2), tmp_path / "b",
                      steps_per_epoch=STEPS, extra_callbacks=[InterruptAt(1, 2)])
    state = json.loads((tmp_path / "b/backup/epochs_0000_0003/state.json").read_text())
    assert (state["epoch"], state["batch"], state["call_step"]) == (1, 2, 6)
    resumed = tiny_model()  # a fresh process would build a fresh model
    h_resumed = trainer.train(resumed, tiny_dataset(), cfg(backup_every_steps=2),
                              tmp_path / "b", steps_per_epoch=STEPS)
    assert h_resumed.resumed_from == {"epoch": 1, "batch": 2, "call_step": 6}
    assert h_straight.resumed_from is None
    for a, b in zip(weights_of(straight), weights_of(resumed)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # the history covers every epoch, and the resumed epoch's loss averages all its batches
    np.testing.assert_allclose(h_resumed.history["loss"], h_straight.history["loss"], rtol=1e-5)
    assert h_resumed.epoch == [0, 1, 2]
    assert not (tmp_path / "b/backup").exists()  # a finished run deletes its backup


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    model = tiny_model()
    # NaN features from data element 5 = epoch 2, batch 2 (1-based)
    with pytest.raises(UserInputError) as err:
        trainer.train(model, tiny_dataset(nan_from_step=5), cfg(backup_every_steps=2),
                      tmp_path, steps_per_epoch=STEPS)
    message = str(err.value)
    assert "epoch 2, batch 2/4" in message
    assert str(tmp_path / "checkpoints" / "latest.weights.h5") in message
    assert "epoch_0001.weights.h5" in message and "step_000000004.weights.h5" in message
    # no checkpoint for the failed epoch, and the good ones hold finite weights
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["epoch_0001.weights.h5", "latest.weights.h5"]
    check = tiny_model()
    check.load_weights(tmp_path / "checkpoints" / "latest.weights.h5")
    assert trainer.weights_are_finite(check)
    # the backup after the NaN step (step 6) was not written; step 4's is kept
    backup = tmp_path / "backup" / "epochs_0000_0003"
    state = json.loads((backup / "state.json").read_text())
    assert state["call_step"] == 4
    check.compile(optimizer="adam")
    check.optimizer.build(check.trainable_variables)
    check.load_weights(backup / state["weights"])
    assert trainer.weights_are_finite(check)


def test_atomic_weights_write_never_leaves_a_partial_file(tmp_path, monkeypatch):
    model = tiny_model()
    target = tmp_path / "latest.weights.h5"
    trainer.save_weights_atomic(model, target)
    before = target.read_bytes()

    def dies_mid_write(path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")
    monkeypatch.setattr(model, "save_weights", dies_mid_write)
    with pytest.raises(OSError):
        trainer.save_weights_atomic(model, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.weights.h5"]
    # temp files of a SIGKILLed writer are cleaned up at the next start
    (tmp_path / ".tmp_123_epoch_0001.weights.h5").write_bytes(b"partial")
    trainer.remove_stale_temp_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.weights.h5"]


def test_training_leaves_only_complete_checkpoints(tmp_path):
    trainer.train(tiny_model(), tiny_dataset(), cfg(backup_every_steps=1), tmp_path,
                  steps_per_epoch=STEPS)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["epoch_0001.weights.h5", "epoch_0002.weights.h5", "epoch_0003.weights.h5",
                     "latest.weights.h5"]
    assert (tmp_path / "checkpoints/latest.weights.h5").read_bytes() == \
        (tmp_path / "checkpoints/epoch_0003.weights.h5").read_bytes()
    assert not (tmp_path / "backup").exists()


def test_backup_of_other_settings_is_refused(tmp_path):
    with pytest.raises(Interrupt):
        trainer.train(tiny_model(), tiny_dataset(), cfg(backup_every_steps=2), tmp_path,
                      steps_per_epoch=STEPS, extra_callbacks=[InterruptAt(0, 2)])
    with pytest.raises(UserInputError, match="steps_per_epoch"):
        trainer.train(tiny_model(), tiny_dataset(), cfg(), tmp_path, steps_per_epoch=STEPS + 1)


def test_config_validation():
    with pytest.raises(ConfigError, match="backup_every_steps"):
        cfg(backup_every_steps=-1).validate()


def test_training_raises_no_user_warning(tmp_path):
    # Keras warns "`shuffle=True` was passed, but will be ignored" for every fit on a
    # tf.data stream unless told shuffle=False: one such line per stage of every run.
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(tiny_model(), tiny_dataset(), cfg(), tmp_path / "w", steps_per_epoch=STEPS)
    assert not [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
