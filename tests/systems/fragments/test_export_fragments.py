"""SavedModel export of the deep-fragment-embedding model: Keras-equal outputs, string look-up,
clear errors, warm-up, saved_model_cli."""
import json
import os
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tests.support.forked_modules import run_python
from tf_twobranch.errors import ConfigError
from tf_twobranch.systems.fragments.export import FragmentServingModule, export_fragment_model
from tf_twobranch.export.serving import read_warmup_requests
from tf_twobranch.systems.fragments.losses import fragment_scores, global_scores
from tf_twobranch.systems.fragments.model import FragmentEmbeddingConfig, build_fragment_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
IA = tf.errors.InvalidArgumentError
RELATIONS = ["nsubj", "dobj", "prep_in"]
WORDS = ["a", "dog", "runs", "in", "the", "park", "red"]
# Not the defaults (5, "paper"): the export must follow the model's configuration.
CONFIG = FragmentEmbeddingConfig(image_dim=6, num_relations=3, vocabulary_size=7, word_dim=4, embed_dim=5,
                                 smoothing=2.0, normaliser="code")
SIGNATURES = ["embed_image_fragments", "embed_sentence_fragments", "embed_sentence_fragment_strings", "score",
              "alignment", "serving_default", "embed_sentences"]


def _model():
    rng = np.random.default_rng(0)
    model = build_fragment_model(CONFIG, rng.normal(size=(7, 4)))
    # Non-zero biases, so that a dropped bias would show.
    model.image_projection.bias.assign(rng.normal(size=5).astype(np.float32))
    encoder = model.sentence_encoder
    encoder.relation_bias.assign(rng.normal(size=encoder.relation_bias.shape).astype(np.float32) * 0.5)
    return model


def _request(seed=1, bi=3, m=4, bs=2, f=5):
    rng = np.random.default_rng(seed)
    image_mask = rng.random((bi, m)) < 0.7
    image_mask[:, 0] = True
    image_mask[-1, 1:] = False
    sentence_mask = rng.random((bs, f)) < 0.7
    sentence_mask[:, 0] = True
    return {"image_fragments": rng.normal(size=(bi, m, 6)).astype(np.float32), "image_mask": image_mask,
            "relation": rng.integers(0, 3, (bs, f)).astype(np.int32),
            "word1": rng.integers(0, 7, (bs, f)).astype(np.int32),
            "word2": rng.integers(0, 7, (bs, f)).astype(np.int32), "sentence_mask": sentence_mask}


def _keras_outputs(model, r):
    v = model.embed_image_fragments(r["image_fragments"])
    s = model.embed_sentence_fragments(r["relation"], r["word1"], r["word2"])
    scores = global_scores(v, r["image_mask"], s, r["sentence_mask"], smoothing=model.config.smoothing,
                           normaliser=model.config.normaliser).numpy()
    valid = r["image_mask"][:, :, None, None] & r["sentence_mask"][None, None, :, :]
    alignment = np.where(valid, fragment_scores(v, s).numpy(), 0.0)
    return v.numpy(), s.numpy(), scores, alignment


def _call(loaded, signature, inputs):
    return {k: v.numpy() for k, v in loaded.signatures[signature](
        **{name: tf.constant(value) for name, value in inputs.items()}).items()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = _model()
    export_dir = export_fragment_model(model, tmp_path_factory.mktemp("fragments") / "export",
                                       relations=RELATIONS, words=WORDS, run_config={"experiment": "test"})
    return model, export_dir, tf.saved_model.load(str(export_dir))


def test_signatures_equal_the_keras_model(exported):
    model, _, loaded = exported
    assert set(loaded.signatures) == set(SIGNATURES)
    r = _request()
    v, s, scores, alignment = _keras_outputs(model, r)
    assert np.abs(scores).max() > 1e-3 and np.abs(alignment).max() > 1e-3   # not vacuous
    got = _call(loaded, "embed_image_fragments", {"image_fragments": r["image_fragments"]})
    np.testing.assert_allclose(got["image_fragment_embedding"], v, atol=1e-5)
    got = _call(loaded, "embed_sentence_fragments", {k: r[k] for k in ("relation", "word1", "word2")})
    np.testing.assert_allclose(got["sentence_fragment_embedding"], s, atol=1e-5)
    for name in ("score", "serving_default"):
        got = _call(loaded, name, r)
        assert got["scores"].shape == (3, 2)
        np.testing.assert_allclose(got["scores"], scores, atol=1e-5)
    got = _call(loaded, "alignment", r)
    assert got["fragment_scores"].shape == (3, 4, 2, 5)
    np.testing.assert_allclose(got["fragment_scores"], alignment, atol=1e-5)
    # Padding is ignored: any id (here -1) and any feature (here NaN) under a False mask.
    padded = dict(r, relation=np.where(r["sentence_mask"], r["relation"], -1),
                  word1=np.where(r["sentence_mask"], r["word1"], 99),
                  image_fragments=np.where(r["image_mask"][:, :, None], r["image_fragments"], np.nan))
    np.testing.assert_allclose(_call(loaded, "score", padded)["scores"], scores, atol=1e-5)
    np.testing.assert_allclose(_call(loaded, "alignment", padded)["fragment_scores"], alignment, atol=1e-5)


def test_string_signature_equals_id_signature(exported):
    _, _, loaded = exported
    relation = [["nsubj", "dobj", ""], ["prep_in", " nsubj ", ""]]
    word1 = [["Dog", "runs", ""], ["in", "the", "  "]]
    word2 = [["a", "PARK", ""], ["red", "dog", ""]]
    got = _call(loaded, "embed_sentence_fragment_strings", {"relation": relation, "word1": word1,
                                                            "word2": word2})["sentence_fragment_embedding"]
    ids = {"relation": np.array([[0, 1, 0], [2, 0, 0]], np.int32),
           "word1": np.array([[1, 2, 0], [3, 4, 0]], np.int32), "word2": np.array([[0, 5, 0], [6, 1, 0]], np.int32)}
    want = _call(loaded, "embed_sentence_fragments", ids)["sentence_fragment_embedding"]
    np.testing.assert_allclose(got[:, :2], want[:, :2], atol=1e-6)
    assert np.abs(got[:, :2]).max() > 0
    np.testing.assert_array_equal(got[:, 2], 0.0)   # padding


@pytest.mark.parametrize("signature,change,message", [
    ("embed_image_fragments", {"image_fragments": np.zeros((2, 3, 5), np.float32)},
     r"image_fragments must have shape \(batch, fragments, 6\); got shape\] \[2 3 5\]"),
    ("embed_image_fragments", {"image_fragments": np.zeros((0, 2, 6), np.float32)}, "image_fragments is empty"),
    ("embed_image_fragments", {"image_fragments": np.full((1, 2, 6), np.inf, np.float32)}, "NaN or inf"),
    ("embed_sentence_fragments", {"word2": np.array([[1, 7]], np.int32)},
     r"word2 must hold word ids \(the rows of the word-vector matrix W_e\) in \[0, 7\); got\] \[7\] "
     r"\[at \[row, column\]\] \[0 1\]"),
    ("embed_sentence_fragments", {"relation": np.array([[-1, 0]], np.int32)}, r"relation must hold relation ids"),
    ("embed_sentence_fragments", {"word1": np.array([[1, 2, 3]], np.int32)}, "word1 must have the shape of relation"),
    ("embed_sentence_fragment_strings", {"word1": [["dog", "cat"]]},
     r"word1: unknown value\] \[cat\] \[at \[row, column\]\] \[0 1\].*vocabulary"),
    ("embed_sentence_fragment_strings", {"relation": [["nsubj", "amod"]]},
     r"relation: unknown value\] \[amod\].*nsubj, dobj, prep_in"),
    ("embed_sentence_fragment_strings", {"word2": [["dog", ""]]}, "padding only when relation, word1 and word2"),
    ("score", {"word1": np.array([[0, 9]], np.int32)}, r"word1 must hold word ids .* in \[0, 7\)"),
    ("score", {"sentence_mask": np.ones((1, 3), bool)},
     r"sentence_mask must have the shape of the first two dimensions of relation"),
    ("score", {"image_mask": np.ones((2,), bool)}, "image_mask must have the shape"),
    ("alignment", {"image_fragments": np.ones((2, 2, 4), np.float32)}, r"image_fragments must have shape"),
])
def test_bad_inputs_fail_with_clear_messages(exported, signature, change, message):
    _, _, loaded = exported
    ids = {"relation": np.array([[0, 1]], np.int32), "word1": np.array([[1, 2]], np.int32),
           "word2": np.array([[3, 4]], np.int32)}
    base = {"embed_image_fragments": {"image_fragments": np.zeros((2, 2, 6), np.float32)},
            "embed_sentence_fragments": ids,
            "embed_sentence_fragment_strings": {"relation": [["nsubj", "dobj"]], "word1": [["dog", "a"]],
                                                "word2": [["runs", "park"]]},
            "score": {"image_fragments": np.zeros((2, 2, 6), np.float32), "image_mask": np.ones((2, 2), bool),
                      **ids, "sentence_mask": np.ones((1, 2), bool)}}
    base["alignment"] = base["score"]
    _call(loaded, signature, base[signature])   # the unchanged request is valid
    with pytest.raises(IA, match=message):
        _call(loaded, signature, {**base[signature], **change})


def test_saved_model_keeps_names_config_and_warmup(exported):
    model, export_dir, loaded = exported
    assert [w.decode() for w in loaded.words.numpy()] == WORDS
    assert [r.decode() for r in loaded.relations.numpy()] == RELATIONS
    assert json.loads(loaded.config_json.numpy().decode()) == model.config.to_dict()
    run_config = json.loads((export_dir / "assets.extra" / "run_config.json").read_text())
    assert run_config["experiment"] == "test"
    assert run_config["fragment_export"]["relations"] == RELATIONS
    requests = read_warmup_requests(export_dir)
    assert sorted(name for name, _ in requests) == sorted(SIGNATURES)
    for name, inputs in requests:
        if name in ("score", "serving_default"):
            want = _keras_outputs(model, inputs)[2]
            np.testing.assert_allclose(_call(loaded, name, inputs)["scores"], want, atol=1e-5)


def test_names_must_fit_the_model(exported, tmp_path):
    model, export_dir, _ = exported
    with pytest.raises(ConfigError, match="relations: got 2 names but the model's num_relations is 3"):
        export_fragment_model(model, tmp_path / "a", relations=RELATIONS[:2], words=WORDS)
    with pytest.raises(ConfigError, match=r"words: names must be unique; repeated: \['dog'\]"):
        export_fragment_model(model, tmp_path / "b", relations=RELATIONS, words=WORDS[:-1] + ["dog"])
    with pytest.raises(FileExistsError):
        export_fragment_model(model, export_dir, relations=RELATIONS, words=WORDS, overwrite=False)


@pytest.mark.slow
def test_saved_model_cli_run_score(exported, tmp_path):
    """`saved_model_cli run` on ``score`` (TF1-style loader, as TF Serving) returns the Keras scores."""
    model, export_dir, _ = exported
    r = _request(seed=3)
    for name, value in r.items():
        np.save(tmp_path / f"{name}.npy", value)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    command = ["-m", "tensorflow.python.tools.saved_model_cli", "run", "--dir", str(export_dir),
               "--tag_set", "serve", "--signature_def", "score",
               "--inputs", ";".join(f"{name}={tmp_path / f'{name}.npy'}" for name in r),
               "--outdir", str(tmp_path / "out")]
    proc = run_python(command, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "out" / "scores.npy"), _keras_outputs(model, r)[2], atol=1e-5)



# ------------------------------------------------------------------ raw inputs: real JPEGs + boxes, real parses

REAL_IMAGES = ["100652400", "1016887272", "101958970"]


def _real_parses(realdata, tmp_path, count=4):
    """Triplets of the first `count` real spaCy parses (Flickr8K CoNLL-U, the parser's own output),
    read as `sentence_inputs` reads them: `read_conllu` then `tree_triplets`."""
    from tf_twobranch.data.formats.conllu import read_conllu
    from tf_twobranch.systems.fragments.sentence_fragments import tree_triplets

    blocks = (realdata / "flickr8k" / "Flickr8k.token.conllu").read_text(encoding="utf-8").split("\n\n")[:count]
    (tmp_path / "parses.conllu").write_text("\n\n".join(blocks) + "\n\n", encoding="utf-8")
    return [tree_triplets(tree, "dependency") for tree in read_conllu(tmp_path / "parses.conllu").values()]


@pytest.mark.parametrize("fine_tuned", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_raw_inputs_equal_the_offline_pipeline_on_real_data(realdata, tmp_path, fine_tuned):
    """Real JPEGs + boxes and real parse triplets: the export's embeddings and S_kl equal the offline
    pipeline's (`extract_fragment_features` + the cache's top layer, `encode_fragments`, the Keras model)."""
    from PIL import Image

    from tf_twobranch.systems.fragments.sentence_fragments import encode_fragments
    from tf_twobranch.export import serving
    from tf_twobranch.systems.fragments.export import triplet_request
    from tf_twobranch.systems.fragments.image_fragments import extract_fragment_features
    from tf_twobranch.systems.fragments.features import (FragmentImages, _folded_top_layer, _scene_cnn_cut,
                                                         fragment_cnn)
    from tf_twobranch.features.scene_cnn import build_scene_cnn
    from tf_twobranch.systems.fragments.sampling import padded_sentence_arrays
    from tests.support.baselines import randomize_weights

    _, extractor = build_scene_cnn(48, 10, feature_dim=8, widths=(4, 4, 8, 8))
    randomize_weights(extractor, seed=2)
    paths = [realdata / "flickr30k" / "images" / f"{i}.jpg" for i in REAL_IMAGES]
    # Two boxes per image but one for the last (inclusive pixels; one with fractional corners).
    boxes = np.zeros((3, 2, 4), np.float32)
    for n, path in enumerate(paths):
        width, height = Image.open(path).size
        boxes[n] = [[0.1 * width, 0.25 * height, 0.6 * width, height - 1], [10, 20, 130, 99]]
    num_boxes = np.array([2, 2, 1], np.int32)
    inputs, mask = extract_fragment_features(dict(zip(REAL_IMAGES, paths)),
                                             {i: boxes[n, :num_boxes[n]] for n, i in enumerate(REAL_IMAGES)},
                                             _scene_cnn_cut(extractor), detections=19)
    # As systems.fragments.pipeline.image_inputs: the cut activations for a fine-tuned row, else the features.
    features = inputs if fine_tuned else FragmentImages(REAL_IMAGES, inputs, mask,
                                                        _folded_top_layer(extractor)).features()
    parses = _real_parses(realdata, tmp_path)
    relations = ["det", "nsubj", "prep", "pobj", "amod"]            # others (e.g. dobj, aux) are dropped
    words = sorted({w for triplets in parses for t in triplets for w in (t.word1, t.word2)} - {"pink", "stairs"})
    rng = np.random.default_rng(0)
    head_dim = 6 if fine_tuned else 0
    config = FragmentEmbeddingConfig(image_dim=int(features.shape[2]), num_relations=len(relations),
                                     vocabulary_size=len(words), word_dim=4, embed_dim=5, image_head_dim=head_dim)
    model = build_fragment_model(config, rng.normal(size=(len(words), 4)).astype(np.float32))
    model.image_projection.bias.assign(rng.normal(size=5).astype(np.float32))
    export_dir = export_fragment_model(model, tmp_path / "export", relations=relations, words=words,
                                       image_cnn=fragment_cnn(extractor, "scene_cnn", fine_tuned=fine_tuned))
    loaded = tf.saved_model.load(str(export_dir))
    assert {"embed_images", "score_jpeg", "embed_sentences"} <= set(loaded.signatures)

    # Offline: the model on the cached features and on the encoded fragments (unknown ones dropped).
    v_offline = model.embed_image_fragments(np.asarray(features, np.float32)).numpy()
    encoded = encode_fragments(parses, relations, {w: i for i, w in enumerate(words)})
    assert 0 < len(encoded.relation) < sum(len(t) for t in parses)      # some dropped, some kept
    padded = padded_sentence_arrays(encoded.relation, encoded.word1, encoded.word2, encoded.row_splits)
    s_offline = model.embed_sentence_fragments(padded["relation"], padded["word1"], padded["word2"])
    scores_offline = global_scores(v_offline, mask, s_offline, padded["sentence_mask"],
                                   **model.config.score_options()).numpy()

    jpegs = [path.read_bytes() for path in paths]
    image_input = {"image_jpeg": jpegs, "boxes": boxes, "num_boxes": num_boxes}
    got = serving.call_signature(loaded, "embed_images", **image_input)
    np.testing.assert_array_equal(got["image_mask"].numpy(), mask[:, :3])
    served = got["image_fragment_embedding"].numpy()
    np.testing.assert_allclose(served[mask[:, :3]], v_offline[mask], atol=1e-4)
    request = triplet_request(parses)
    got = serving.call_signature(loaded, "embed_sentences", **request)
    kept = got["sentence_mask"].numpy()
    np.testing.assert_array_equal(kept.sum(axis=1), np.diff(encoded.row_splits))
    np.testing.assert_allclose(got["sentence_fragment_embedding"].numpy()[kept],
                               s_offline.numpy()[padded["sentence_mask"]], atol=1e-4)
    scores = serving.call_signature(loaded, "score_jpeg", **image_input, **request)["scores"].numpy()
    assert np.ptp(scores_offline) > 1e-3                                 # not vacuous
    np.testing.assert_allclose(scores, scores_offline, atol=1e-4)
    assert {"embed_images", "score_jpeg", "embed_sentences"} <= {name for name, _ in read_warmup_requests(export_dir)}
    serving.replay_warmup_file(export_dir)


def test_serving_doc_spacy_recipe_feeds_embed_sentences(tmp_path):
    """docs/SERVING.md's client-side parse recipe, run as written (a saved stand-in parser pipeline
    for en_core_web_sm), gives ``embed_sentences`` its inputs."""
    pytest.importorskip("spacy")
    import re

    from test_spacy_parses import saved_chain_parser_pipeline
    from tf_twobranch.systems.fragments.export import FragmentServingModule

    doc = (REPO_ROOT / "docs" / "SERVING.md").read_text(encoding="utf-8")
    recipe = next(block for block in re.findall(r"```python\n(.*?)```", doc, re.S) if "load_spacy_model" in block)
    pipeline = saved_chain_parser_pipeline(tmp_path / "pipeline")
    namespace = {}
    exec(recipe.replace('"en_core_web_sm"', repr(str(pipeline))), namespace)   # noqa: S102 - the doc's own code
    request = namespace["request"]
    # The chain parser labels every edge "dep": fragments (dep, next word, word), lower-cased.
    assert request["relation"][0][:2] == ["dep", "dep"] and request["word1"][0][:2] == ["dog", "runs"]
    words = sorted({w for name in ("word1", "word2") for row in request[name] for w in row if w})
    config = FragmentEmbeddingConfig(image_dim=6, num_relations=1, vocabulary_size=len(words), word_dim=4,
                                     embed_dim=5)
    module = FragmentServingModule(build_fragment_model(config, np.ones((len(words), 4), np.float32)), ["dep"],
                                   words)
    out = module.embed_sentences(**{k: tf.constant(v) for k, v in request.items()})
    np.testing.assert_array_equal(out["sentence_mask"].numpy(), np.array(request["relation"]) != "")


def test_declared_sizes_refuse_a_wrong_rank_before_the_graph(exported):
    # A declared (None, None, 6) spec lets the graph fold its rank check, so a wrong rank is refused
    # by the spec check; the in-graph check still names it where the rank is not declared.
    from tf_twobranch.errors import UserInputError
    from tf_twobranch.export import serving
    _, _, loaded = exported
    with pytest.raises(UserInputError, match=r"input 'image_fragments': expected float32 of shape \(batch, \?, 6\)"):
        serving.call_signature(loaded, "embed_image_fragments", image_fragments=np.zeros((2, 6), np.float32))
    module = FragmentServingModule(_model(), RELATIONS, WORDS)
    with pytest.raises(IA, match=r"image_fragments must have shape \(batch, fragments, 6\)"):
        module._validate_image_fragments(tf.zeros((2, 6)))


# ------------------------------------------------------------------ issue 39: edge cases a direct client meets

@pytest.fixture(scope="module")
def jpeg_export(tmp_path_factory):
    """The tiny export with the CNN (JPEG bytes + boxes) and a gallery (tests/support/serving_exports.py)."""
    from tests.support.serving_exports import shared_export
    return tf.saved_model.load(str(shared_export("fragment", tmp_path_factory)))


def test_whole_image_only_queries_take_boxes_of_no_slot(jpeg_export):
    """Boxes shaped (B, 0, 4): fragment 0 (the whole image) alone, as with padded box slots and
    num_boxes 0 (issue 39 item 6: it was `Reduction axis 0 is empty`)."""
    from tests.support.serving_exports import jpeg
    images = tf.constant([jpeg(1), jpeg(2, 30, 50)])
    none = {"image_jpeg": images, "boxes": tf.zeros([2, 0, 4]), "num_boxes": tf.zeros([2], tf.int32)}
    padded = dict(none, boxes=tf.zeros([2, 1, 4]))
    got = jpeg_export.signatures["embed_images"](**none)
    want = jpeg_export.signatures["embed_images"](**padded)
    assert got["image_mask"].numpy().tolist() == [[True], [True]]
    np.testing.assert_allclose(got["image_fragment_embedding"].numpy(),
                               want["image_fragment_embedding"].numpy()[:, :1], atol=1e-6)
    k = tf.constant(2)
    got = jpeg_export.signatures["retrieve_captions"](**none, k=k)
    want = jpeg_export.signatures["retrieve_captions"](**padded, k=k)
    np.testing.assert_array_equal(got["caption_index"].numpy(), want["caption_index"].numpy())
    np.testing.assert_allclose(got["scores"].numpy(), want["scores"].numpy(), atol=1e-6)


@pytest.mark.parametrize("signature,inputs,message", [
    ("embed_image_fragments", {"image_fragments": np.zeros((2, 6), np.float32)},
     r"image_fragments must have shape \(batch, fragments, 6\); got shape\] \[2 6\]"),
    ("embed_image_fragments", {"image_fragments": np.zeros((1, 2, 5), np.float32)},
     r"image_fragments must have shape \(batch, fragments, 6\); got shape\] \[1 2 5\]"),
    ("embed_sentence_fragments", {"relation": np.zeros((2,), np.int32), "word1": np.zeros((2,), np.int32),
                                  "word2": np.zeros((2,), np.int32)},
     r"relation must have shape \(batch, fragments\) of int32 ids; got shape\] \[2\]"),
])
def test_direct_calls_of_other_shapes_meet_the_graphs_checks(exported, signature, inputs, message):
    """A client feeding a signature directly (TF Serving, ``loaded.signatures``) is not held to the
    declared shapes: the graph's checks name what it got (issue 39 item 6)."""
    _, _, loaded = exported
    with pytest.raises(IA, match=message):
        _call(loaded, signature, inputs)


def test_direct_call_with_boxes_of_another_shape(jpeg_export):
    from tests.support.serving_exports import jpeg
    with pytest.raises(IA, match=r"boxes must have shape \(batch, boxes, 4\) as \[x1, y1, x2, y2\]; got shape\] "
                                 r"\[2 3\]"):
        jpeg_export.signatures["embed_images"](image_jpeg=tf.constant([jpeg(1), jpeg(2)]), boxes=tf.zeros([2, 3]),
                                               num_boxes=tf.zeros([2], tf.int32))


def test_run_config_holds_the_word_list(exported):
    """docs/SERVING.md: the relation names and the words (id order) are in run_config.json too."""
    _, export_dir, _ = exported
    run_config = json.loads((export_dir / "assets.extra" / "run_config.json").read_text())
    assert run_config["fragment_export"]["words"] == WORDS
    assert run_config["fragment_export"]["relations"] == RELATIONS


def test_saved_model_cli_wrapper_names_dropped_words_and_refusals_in_one_line(exported, tmp_path):
    """The README's `embed_sentences` command on words the model does not know: the wrapper names the
    dropped words on one note line, and a sentence left with nothing is one error line, exit status 2,
    no traceback (issue 39 item 3)."""
    from tests.support.forked_modules import run_modules
    _, export_dir, _ = exported
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))

    def command(exprs, out):
        return ["tf_twobranch.tools.saved_model_cli", "run", "--dir", str(export_dir), "--tag_set", "serve",
                "--signature_def", "embed_sentences", "--input_exprs", exprs, "--outdir", str(tmp_path / out)]

    unknown, partly = run_modules([
        command('relation=[["nsubj"]];word1=[["sleeps"]];word2=[["cat"]]', "unknown"),
        command('relation=[["nsubj", "nsubj"]];word1=[["runs", "sleeps"]];word2=[["dog", "cat"]]', "partly")],
        env=env)
    assert unknown.returncode == 2, unknown.stderr[-2000:]
    assert "Traceback" not in unknown.stderr
    errors = [line for line in unknown.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "signature 'embed_sentences' refused the request" in errors[0]
    assert "a sentence has no fragment the model knows" in errors[0]
    assert "note: not in the model's vocabulary, dropped: cat, sleeps" in unknown.stderr
    assert partly.returncode == 0, partly.stderr[-2000:]
    assert "dropped: cat, sleeps" in partly.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "partly" / "sentence_mask.npy"), [[True, False]])
