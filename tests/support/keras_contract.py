"""The Keras `Loss` contract, checked the same way for every loss class of the package."""
import inspect

import keras
import numpy as np


def assert_keras_loss_contract(loss, y_true, y_pred, expected_value, expected_per_example, tmp_path,
                               *, rtol=1e-5, atol=1e-7):
    """Check that `loss` is a Keras loss in full, not only something that looks like one.

    `expected_value` is the pure function's (reduced) value on (y_true, y_pred)
    and `expected_per_example` its unreduced per-example values.

    (a) `loss(y_true, y_pred)` is the pure function's value;
    (b) `sample_weight` of ones changes nothing, and with zeros on every other
        example the value follows the rule of Keras's default reduction,
        which is read off `keras.losses.MeanSquaredError` given the same
        per-example values (not assumed);
    (c) `reduction=None`/"none" gives the per-example values and "sum" their sum;
    (d) the config holds every constructor argument; `keras.losses.serialize`
        and `deserialize` round-trip it; and a model compiled with the loss,
        saved to a `.keras` file and loaded back, has the same loss.
    """
    cls = type(loss)
    per_example = np.asarray(expected_per_example, np.float64)
    n = len(per_example)
    assert per_example.shape == (n,) and n >= 2
    np.testing.assert_allclose(per_example.mean(), float(expected_value), rtol=rtol, atol=atol)

    # (a) default reduction, no weights: the pure function's value.
    value = loss(y_true, y_pred)
    assert tuple(value.shape) == ()
    np.testing.assert_allclose(float(value), float(expected_value), rtol=rtol, atol=atol)

    # (b) sample weights, the Keras way.
    np.testing.assert_allclose(float(loss(y_true, y_pred, sample_weight=np.ones(n, np.float32))),
                               float(expected_value), rtol=rtol, atol=atol)
    weights = (np.arange(n) % 2 == 0).astype(np.float32)     # zero on every other example
    kept = per_example[weights > 0]
    # "sum_over_batch_size": sum of the weighted values over the number of
    # values, i.e. the mean over the weighted examples times their share.
    rule = kept.mean() * len(kept) / n
    mse = keras.losses.MeanSquaredError()            # per-example value: mean of squares
    as_mse = (np.zeros((n, 1), np.float32), np.sqrt(per_example)[:, None].astype(np.float32))
    np.testing.assert_allclose(float(mse(*as_mse)), per_example.mean(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(float(mse(*as_mse, sample_weight=weights)), rule, rtol=rtol, atol=atol)
    np.testing.assert_allclose(float(loss(y_true, y_pred, sample_weight=weights)), rule,
                               rtol=rtol, atol=atol)

    # (c) other reductions.
    config = loss.get_config()
    for reduction in (None, "none"):
        values = cls.from_config(dict(config, reduction=reduction))(y_true, y_pred)
        assert tuple(values.shape) == (n,), reduction
        np.testing.assert_allclose(np.asarray(values), per_example, rtol=rtol, atol=atol)
    total = cls.from_config(dict(config, reduction="sum"))(y_true, y_pred)
    np.testing.assert_allclose(float(total), per_example.sum(), rtol=rtol, atol=atol)

    # (d) config, serialization and a saved model.
    arguments = set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
    assert arguments <= set(config), arguments - set(config)
    serialized = keras.losses.serialize(loss)
    assert serialized["registered_name"] == f"tf_twobranch>{cls.__name__}"
    restored = keras.losses.deserialize(serialized)
    assert type(restored) is cls and restored.get_config() == config
    np.testing.assert_allclose(float(restored(y_true, y_pred)), float(value), rtol=rtol, atol=atol)

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=loss)
    path = tmp_path / f"{cls.__name__}.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.loss) is cls and loaded.loss is not loss
    assert loaded.loss.get_config() == config
    np.testing.assert_allclose(float(loaded.loss(y_true, y_pred)), float(value), rtol=rtol, atol=atol)
