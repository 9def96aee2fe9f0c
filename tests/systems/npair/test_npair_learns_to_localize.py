"""End to end: the N-pair training path learns to localize (Das et al., issue 39 item 9).

A tiny synthetic set stands in for the embedded scenes: 6 × 6 backbone maps, each image holding
two objects of distinct classes in two cells (the class's signature in that cell, noise
elsewhere), and a caption naming both ("a w3 and a w5"). The model is built from the recipe the
experiment builds for the embedded data (its profile) and trained as `_train` trains it (SGD
with momentum, the recipe's rate and batch of distinct images); after a few hundred steps each
object word's heat map must peak in its object's cell.

S_MaxImage takes the maximum over the map's cells, so translating the projected map changes no
score: a k × k projection convolution is free to learn a shifted map (off-centre taps), and on
maps whose cells are as large as the objects (6 × 6 on 96-px scenes) the shifted maximum lands in
the neighbouring cell. The default embedded projection ("centred") cannot translate the map.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from experiments import npair as experiment
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.evaluation.pointing_game import PointingQuery
from tf_twobranch.systems.npair.features import NPairText, encode_token_lists
from tf_twobranch.systems.npair.model import build_npair_model
from tf_twobranch.systems.npair import pipeline as npair

SIDE, CHANNELS, CLASSES = 6, 16, 6
WORDS = [f"w{k}" for k in range(CLASSES)]
VOCAB = ["<pad>", "<unk>", "<start>", "<end>", "a", "and"] + WORDS


def _scenes(n, rng):
    """(n, 6, 6, C) maps, the two (class, row, column) objects of each image, their captions.

    An object's signature is strongest in its cell and weaker in the 8 around it (a CNN map's
    cells see far beyond themselves: the embedded scene CNN's receptive field is 79 px of 96)."""
    signatures = np.eye(CHANNELS)[:CLASSES] * 2.0
    backgrounds = np.eye(CHANNELS)[CHANNELS - 3:]                 # three background textures
    maps = rng.normal(0.0, 0.1, (n, SIDE, SIDE, CHANNELS)).astype(np.float32)
    objects, captions = [], []
    for i in range(n):
        maps[i] += backgrounds[rng.integers(3)]
        classes = rng.choice(CLASSES, 2, replace=False)
        cells = rng.choice(SIDE * SIDE, 2, replace=False)
        placed = [(int(k), int(c) // SIDE, int(c) % SIDE) for k, c in zip(classes, cells)]
        for k, r, c in placed:
            maps[i, max(r - 1, 0):r + 2, max(c - 1, 0):c + 2] += 0.4 * signatures[k]
            maps[i, r, c] += 0.6 * signatures[k]
        for k, r, c in placed:                                      # the object hides the background
            maps[i, r, c, CHANNELS - 3:] *= 0.2
        objects.append(placed)
        captions.append(["a", WORDS[placed[0][0]], "and", "a", WORDS[placed[1][0]]])
    return np.maximum(maps, 0.0), objects, captions   # a ReLU map, like the backbone's


def _embedded_recipe(**typed):
    """The recipe the experiment builds for npair_table2_npair_word.cfg on the embedded data."""
    fv = flags.FlagValues()
    experiment.define_flags(fv)
    fv(["prog", "--flagfile=experiments/configs/npair_table2_npair_word.cfg",
        *[f"--{k}={v}" for k, v in typed.items()]])
    return experiment.recipe_from_flags(fv)[0]


def _train_and_point(recipe, steps=300, seed=0):
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    maps, _, captions = _scenes(512, rng)
    tokens = encode_token_lists(captions, VOCAB, max_words=recipe.max_words)
    # Distributional vectors learnt from template captions: the object words occur in the same
    # contexts, so their vectors nearly coincide (the embedded PPMI-SVD vectors: cos 0.8-0.9).
    word_matrix = rng.normal(0.0, 1.0, (len(VOCAB), 16)).astype(np.float32)
    shared = rng.normal(0.0, 1.0, 16)
    for k in range(CLASSES):
        word_matrix[VOCAB.index(WORDS[k])] = shared + rng.normal(0.0, 0.3, 16)
    text = NPairText(VOCAB, word_matrix, {"train": tokens}, recipe.max_words)
    config = npair.build_config(recipe, text, {"train": maps})
    model = build_npair_model(config, word_matrix)
    optimizer = keras.optimizers.SGD(recipe.learning_rate, momentum=recipe.momentum,
                                     weight_decay=recipe.weight_decay or None)
    model.compile(optimizer=optimizer)
    batch = 32

    def batches():
        order = np.random.default_rng(seed + 1)
        while True:
            rows = order.choice(len(maps), batch, replace=False)
            yield {"backbone_map": maps[rows], "token_ids": tokens.token_ids[rows],
                   "token_mask": tokens.token_mask[rows]}

    spec = {"backbone_map": tf.TensorSpec((batch, SIDE, SIDE, CHANNELS), tf.float32),
            "token_ids": tf.TensorSpec((batch, tokens.token_ids.shape[1]), tf.int32),
            "token_mask": tf.TensorSpec((batch, tokens.token_mask.shape[1]), tf.bool)}
    dataset = tf.data.Dataset.from_generator(batches, output_signature=spec)
    history = model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)

    # Test scenes: each object word's map (word mode, its own sentence) must peak in its cell.
    test_maps, test_objects, test_captions = _scenes(100, np.random.default_rng(seed + 2))
    projected = localization_maps.projected_maps(model, test_maps)
    queries, cells = [], []
    for i, (placed, words) in enumerate(zip(test_objects, test_captions)):
        for (k, r, c), position in zip(placed, (1, 4)):
            queries.append(PointingQuery(image_id=str(i), sentence_index=0, phrase_index=position,
                                         caption_words=words, word_span=(position, position + 1),
                                         phrase=WORDS[k], boxes=np.zeros((1, 4), np.float32),
                                         image_width=96, image_height=96))
            cells.append((r, c))
    heat = localization_maps.query_heat_maps(model, dict(zip(map(str, range(100)), projected)), queries,
                                             VOCAB, mode="word")
    peaks = [np.unravel_index(int(np.argmax(h)), h.shape) for h in heat]
    hits = np.array([p == cell for p, cell in zip(peaks, cells)])
    return float(hits.mean()), history.history["loss"][-1], float(hits[0::2].mean()), float(hits[1::2].mean())


def test_embedded_recipe_projects_without_translating_the_map():
    recipe = _embedded_recipe()
    assert recipe.projection == "centred"
    assert recipe.train_word_vectors            # the PPMI-SVD stand-ins give the digit words one vector
    assert _embedded_recipe(projection="conv").projection == "conv"      # typed flags still win


@pytest.mark.slow
def test_trained_word_maps_peak_in_their_objects_cell():
    on_cell, loss, _, _ = _train_and_point(_embedded_recipe())
    assert loss < 2.0 * np.log(32) - 1.0, loss          # it trained (chance: 2·log 32 = 6.93)
    assert on_cell >= 0.9, f"only {on_cell:.0%} of the word maps peak in their object's cell"


@pytest.mark.parametrize("kernel", [3, 5])
def test_centred_projection_cannot_move_the_map(kernel):
    # Mirroring the backbone map mirrors the centred projection's output whatever its weights: no
    # cell's vector can lean towards one side. A k×k convolution's learnt kernel can (and on the
    # embedded data did): it is not mirror-equivariant.
    from tf_twobranch.systems.npair.model import NPairLocalizationConfig
    rng = np.random.default_rng(3)
    maps = rng.normal(size=(2, SIDE, SIDE, 4)).astype(np.float32)
    for projection, symmetric in (("centred", True), ("conv", False)):
        model = build_npair_model(NPairLocalizationConfig(
            vocabulary_size=len(VOCAB), map_channels=4, map_size=SIDE, word_dim=3, embed_dim=5,
            projection=projection, projection_kernel=kernel))
        for layer in model.projection.layers:             # random weights, not an initialiser's symmetry
            for w in layer.weights:
                if w.trainable:
                    w.assign(rng.normal(size=w.shape).astype(np.float32))
        out = np.asarray(model.image_maps({"backbone_map": maps}))
        mirrored = np.asarray(model.image_maps({"backbone_map": maps[:, :, ::-1]}))[:, :, ::-1]
        assert np.allclose(out, mirrored, atol=1e-5) == symmetric, projection


def test_pointing_results_record_both_point_rules():
    # One map peaking in the top-right cell of a 6 × 6 map; the digit's box lies inside that
    # cell, away from the image's edge: the cell centre (88, 8) hits, LocNet's (88, 0) misses.
    heat = np.zeros((SIDE, SIDE))
    heat[0, 5] = 1.0
    query = PointingQuery(image_id="1", sentence_index=0, phrase_index=0, caption_words=["a", "w1"],
                          word_span=(0, 2), phrase="a w1", boxes=np.array([[82, 3, 93, 14]], np.float32),
                          image_width=96, image_height=96)
    result = localization_maps.pointing_results([query], [heat])
    assert result["point_rule"] == "cell_centre" and result["accuracy"] == 100.0
    assert result["accuracy_by_point_rule"] == {"cell_centre": 100.0, "argmax": 0.0}
    assert localization_maps.pointing_results([query], [heat], point_rule="argmax")["accuracy"] == 0.0
    # Baseline points take no rule.
    assert localization_maps.pointing_results([query], points=[(88, 8)])["point_rule"] is None
