"""Das et al.: `--normalisation=map` is LocNet's L2 norm, and the N-pair temperature has one default."""
import inspect

import numpy as np
from absl import flags

from experiments import npair as experiment
from tf_twobranch.systems.npair import heat_map_volume as lv
from tf_twobranch.systems.npair import losses as npair
from tf_twobranch.systems.npair.model import NPairLocalizationConfig


def locnet_l2(x):
    """LocNet models/models.py, as written: ``norm = x.view(x.size(0), -1).norm(p=2, dim=1,
    keepdim=True); x.view(x.size(0), -1).div(norm.expand_as(...)).view(x.size())``."""
    flat = x.reshape(x.shape[0], -1)
    norm = np.sqrt(np.sum(flat.astype(np.float64) ** 2, axis=1, keepdims=True))
    return (flat / norm).reshape(x.shape)


def test_map_normalisation_is_locnets_norm_over_every_position():
    rng = np.random.default_rng(0)
    # A ReLU map (B, H, W, d) and LSTM outputs at T = 7 positions: <start>, words, <end>, padding.
    maps = np.maximum(rng.normal(size=(3, 2, 3, 4)), 0).astype(np.float32)
    tokens = rng.normal(size=(3, 7, 4)).astype(np.float32)
    words = np.array([2, 4, 1])
    mask = (np.arange(7)[None, :] >= 1) & (np.arange(7)[None, :] <= words[:, None])
    got_maps, got_tokens = lv.normalise_localization_inputs(maps, tokens, mask, "map")
    # LocNet's VGG19 branch takes (B, d, H, W); the flattened norm is the same whatever the order.
    np.testing.assert_allclose(got_maps.numpy(), locnet_l2(maps), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_tokens.numpy(), locnet_l2(tokens), rtol=1e-6, atol=1e-7)
    # The mask does not enter: the norm over the real tokens alone would differ.
    other_mask = np.ones_like(mask)
    np.testing.assert_array_equal(lv.normalise_localization_inputs(maps, tokens, other_mask, "map")[1].numpy(),
                                  got_tokens.numpy())
    real_only = np.sqrt(np.sum(tokens[0][mask[0]] ** 2))
    assert not np.allclose(got_tokens.numpy()[0], tokens[0] / real_only, rtol=1e-3)


def test_other_normalisations_are_unchanged():
    rng = np.random.default_rng(1)
    maps = rng.normal(size=(2, 2, 2, 3)).astype(np.float32)
    tokens = rng.normal(size=(2, 5, 3)).astype(np.float32)
    mask = np.arange(5)[None, :] < np.array([[2], [4]])
    a, s = lv.normalise_localization_inputs(maps, tokens, mask, "vector")
    np.testing.assert_allclose(a.numpy(), maps / np.linalg.norm(maps, axis=-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(s.numpy(), tokens / np.linalg.norm(tokens, axis=-1, keepdims=True), rtol=1e-6)
    a, s = lv.normalise_localization_inputs(maps, tokens, mask, "none")
    np.testing.assert_array_equal(a.numpy(), maps)
    np.testing.assert_array_equal(s.numpy(), tokens)


def test_temperature_has_one_default():
    fv = flags.FlagValues()
    experiment.define_flags(fv)
    fv(["prog"])
    defaults = {
        "constant": npair.DEFAULT_TEMPERATURE,
        "config": NPairLocalizationConfig(vocabulary_size=3, map_channels=2).temperature,
        "npair_loss": inspect.signature(npair.npair_loss).parameters["temperature"].default,
        "localization_batch_loss":
            inspect.signature(npair.localization_batch_loss).parameters["temperature"].default,
        "NPairLoss": npair.NPairLoss().temperature,
        "--temperature": fv["temperature"].default,
    }
    assert len(set(defaults.values())) == 1, defaults
    # The value the shipped flagfiles' rows were measured with (BUILD_NOTES.md, Das et al.).
    assert npair.DEFAULT_TEMPERATURE == 0.1
