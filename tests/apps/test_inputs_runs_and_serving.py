"""Issue 23, items 5-8: checkpoints, --batch_size/--top_k, serving dtypes and run-folder kinds
give messages naming the file, flag or input and what was expected, never a raw traceback."""
import json
import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.support.forked_modules import run_python
from experiments import common
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ item 5: checkpoints


def _two_branch_run(run_dir: pathlib.Path):
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
    config = TwoBranchConfig(image_dim=6, text_dim=5, image_hidden=(8,), text_hidden=(8,), embed_dim=4)
    model = build_model(config)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "run_config.json").write_text(json.dumps({"model": config.to_dict()}))
    weights = run_dir / "checkpoints" / "latest.weights.h5"
    model.save_weights(weights)
    return model, weights


def test_truncated_checkpoint_names_the_file(tmp_path):
    from tf_twobranch.runs import load_run
    _, weights = _two_branch_run(tmp_path / "run")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError) as err:
        load_run(tmp_path / "run")
    message = str(err.value)
    assert message.startswith(str(weights)) and "not a complete HDF5 file" in message
    assert "expected a .weights.h5 file written by Keras" in message and "truncated" in message


def test_nan_checkpoint_names_the_file_and_the_variable(tmp_path):
    from tf_twobranch.runs import load_run
    model, weights = _two_branch_run(tmp_path / "run")
    variable = model.weights[2]
    variable.assign(np.full(variable.shape, np.nan, np.float32))
    model.save_weights(weights)
    with pytest.raises(DataFormatError) as err:
        load_run(tmp_path / "run")
    message = str(err.value)
    assert message.startswith(str(weights)) and repr(variable.path) in message
    assert "NaN or inf" in message and "expected finite weights" in message


def test_every_checkpoint_load_goes_through_the_one_helper():
    # load_weights outside tf_twobranch/checkpoints.py would bring h5py's raw errors back; the
    # backbones read ImageNet weights files, not run checkpoints, with their own messages.
    allowed = {"tf_twobranch/checkpoints.py", "tf_twobranch/features/backbones.py"}
    offenders = []
    for folder in ("tf_twobranch", "experiments"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            relative = path.relative_to(REPO_ROOT).as_posix()
            if relative not in allowed and re.search(r"\.load_weights\(", path.read_text(encoding="utf-8")):
                offenders.append(relative)
    assert offenders == []


# ------------------------------------------------------------------ item 6: --batch_size / --top_k


def test_batch_size_below_top_k_is_refused_before_any_data_is_read(tmp_path):
    from experiments import two_branch_retrieval as isr
    fv = common.parse_flagfile(isr.define_flags,
                               str(common.resolve_config("two_branch_table2_b6_nonlinear_bidir_nbr_constraints")),
                               [f"--dataset_dir={tmp_path / 'no_such_folder'}", "--batch_size=5", "--top_k=10",
                                f"--run_dir={tmp_path / 'run'}"])
    # The dataset folder does not exist: reaching the data would be another error.
    with pytest.raises(UserInputError, match=r"--batch_size=5 is below --top_k=10"):
        isr.run(fv)
    assert not (tmp_path / "run").exists()


def test_the_library_check_names_both_settings():
    from tf_twobranch.systems.two_branch.losses import check_top_k_fits_batch
    with pytest.raises(ConfigError, match=r"batch_size=3 is below top_k=4.*batch_size >= 4 or top_k <= 3"):
        check_top_k_fits_batch(4, 3)
    check_top_k_fits_batch(4, 4)


def test_static_ranking_loss_traced_with_unknown_sizes_takes_small_batches():
    # The image-sentence train step traces the loss with unknown batch sizes; fewer images than
    # the positives cap (8) made TopKV2 fail with "input must have at least k columns".
    from tf_twobranch.systems.two_branch import losses
    rng = np.random.default_rng(0)
    images = tf.math.l2_normalize(rng.normal(size=(4, 8)).astype(np.float32), axis=1)
    texts = tf.math.l2_normalize(rng.normal(size=(8, 8)).astype(np.float32), axis=1)
    labels = np.zeros((8, 4), bool)
    labels[np.arange(8), np.arange(8) % 4] = True
    traced = tf.function(
        lambda i, t, l: losses.bidirectional_ranking_loss(i, t, l, top_k=3, static_shapes=True),
        input_signature=[tf.TensorSpec((None, 8)), tf.TensorSpec((None, 8)), tf.TensorSpec((None, None), tf.bool)])
    expected = losses.bidirectional_ranking_loss(images, texts, labels, top_k=3)
    np.testing.assert_allclose(float(traced(images, texts, labels)), float(expected), rtol=1e-6)


# ------------------------------------------------------------------ item 7: serving dtypes


class _Serving(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32, name="image_features"),
                                  tf.TensorSpec(None, tf.string, name="image_jpeg")])
    def embed(self, image_features, image_jpeg):
        return {"width": tf.shape(image_features)[-1], "count": tf.size(image_jpeg)}

    @tf.function(input_signature=[tf.TensorSpec((None, 2), tf.int32, name="word_ids")])
    def words(self, word_ids):
        return {"total": tf.reduce_sum(word_ids)}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    module = _Serving()
    path = tmp_path_factory.mktemp("export") / "model"
    tf.saved_model.save(module, str(path), signatures={"embed": module.embed, "words": module.words})
    return path


def test_call_signature_names_the_input_and_the_expected_dtype(saved_model):
    from tf_twobranch.export.serving import call_signature
    loaded = tf.saved_model.load(str(saved_model))
    jpeg = np.array([b"\xff\xd8\xff"], dtype=object)
    out = call_signature(loaded, "embed", image_features=np.ones((2, 3), np.float32), image_jpeg=jpeg)
    assert int(out["width"]) == 3
    with pytest.raises(UserInputError, match=r"signature 'embed', input 'image_features': expected float32, "
                                             r"got a float64 array of shape \(2, 3\); cast it first"):
        call_signature(loaded, "embed", image_features=np.ones((2, 3)), image_jpeg=jpeg)
    with pytest.raises(UserInputError, match=r"input 'image_features': expected float32, got a float64 tensor"):
        call_signature(loaded, "embed", image_features=tf.ones((2, 3), tf.float64), image_jpeg=jpeg)
    with pytest.raises(UserInputError, match=r"input 'image_jpeg': expected string, got a uint8 array of shape "
                                             r"\(1, 4, 4, 3\) \(pixels\?\); this input takes the encoded"):
        call_signature(loaded, "embed", image_features=np.ones((2, 3), np.float32),
                       image_jpeg=np.zeros((1, 4, 4, 3), np.uint8))
    with pytest.raises(UserInputError, match=r"missing \['image_jpeg'\]"):
        call_signature(loaded, "embed", image_features=np.ones((2, 3), np.float32))


def test_call_signature_checks_a_known_shape_and_casts_fitting_integers(saved_model):
    from tf_twobranch.export.serving import call_signature
    loaded = tf.saved_model.load(str(saved_model))
    assert int(call_signature(loaded, "words", word_ids=np.array([[1, 2], [3, 4]]))["total"]) == 10  # int64
    with pytest.raises(UserInputError, match=r"input 'word_ids': expected int32 of shape \(batch, 2\), "
                                             r"got an int64 array of shape \(2, 3\)"):
        call_signature(loaded, "words", word_ids=np.ones((2, 3), np.int64))
    with pytest.raises(UserInputError, match=r"outside the int32 range"):
        call_signature(loaded, "words", word_ids=np.array([[1, 2 ** 40]]))


def test_saved_model_cli_tool_refuses_a_wrong_dtype_without_a_traceback(saved_model, tmp_path):
    np.save(tmp_path / "features.npy", np.ones((1, 3)))                  # float64
    np.save(tmp_path / "jpeg.npy", np.array([b"\xff\xd8\xff"], dtype=object))
    proc = run_python(
        ["-m", "tf_twobranch.tools.saved_model_cli", "run", "--dir", str(saved_model),
         "--tag_set", "serve", "--signature_def", "embed", "--inputs",
         f"image_features={tmp_path / 'features.npy'};image_jpeg={tmp_path / 'jpeg.npy'}",
         "--outdir", str(tmp_path / "out")], cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "input 'image_features': expected float32, got a float64 array" in proc.stderr


# ------------------------------------------------------------------ item 8: run-folder kinds


def _write(path: pathlib.Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_draw_tools_name_the_run_kind_and_the_tool_to_use(tmp_path):
    from experiments import fragments_draw, npair_draw
    npair_run, fragment_run, retrieval_run = tmp_path / "npair", tmp_path / "fragments", tmp_path / "retrieval"
    _write(npair_run / "results.json", {"task": "npair", "row_kind": "model"})
    _write(fragment_run / "stage1" / "run_config.json", {"task": "fragments"})
    _write(fragment_run / "results.json", {"stages": []})
    _write(retrieval_run / "run_config.json", {"model": {"kind": "embedding"}})   # an older run: no task
    with pytest.raises(UserInputError) as err:
        fragments_draw.draw_fragments(npair_run, tmp_path / "out")
    assert "an N-pair localization run (Das et al.)" in str(err.value)
    assert f"python -m experiments.npair_draw --run_dir={npair_run}" in str(err.value)
    with pytest.raises(UserInputError) as err:
        npair_draw.draw(fragment_run, tmp_path / "out", [0])
    assert "a deep-fragment-embedding run" in str(err.value)
    assert str(fragment_run / "stage1" / "run_config.json") in str(err.value)
    assert "python -m experiments.fragments_draw" in str(err.value)
    with pytest.raises(UserInputError, match=r"an image-sentence retrieval run .* no draw tool takes"):
        npair_draw.draw(retrieval_run, tmp_path / "out", [0])


def test_draw_region_phrase_refuses_another_family_without_a_traceback(tmp_path):
    run = tmp_path / "npair"
    _write(run / "results.json", {"task": "npair"})
    proc = run_python(["-m", "experiments.two_branch_draw", f"--run_dir={run}",
                       f"--out_dir={tmp_path / 'out'}"], cwd=REPO_ROOT,
                      timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "an N-pair localization run" in proc.stderr and "experiments.npair_draw" in proc.stderr


def test_every_experiment_records_its_task():
    from tf_twobranch import systems
    for system in systems.all():
        folder = REPO_ROOT / "tf_twobranch" / "systems" / system.name
        for task in system.tasks:
            source = (REPO_ROOT / (task.experiment.replace(".", "/") + ".py")).read_text(encoding="utf-8")
            # An experiment whose row runs in its system's pipeline records the task there.
            source += "".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.py")))
            assert f'"task": "{task.name}"' in source, task.experiment


def test_load_run_on_a_cca_run_says_what_it_is(tmp_path):
    # Issue 39: "load_run on a CCA run says 'needs run_config.json'".
    import json

    from tf_twobranch.errors import UserInputError
    from tf_twobranch.runs import load_run, run_results

    run = tmp_path / "cca_row"
    run.mkdir()
    record = {"row": "image_sentence", "task": "two_branch_retrieval", "flags": {"model": "cca"},
              "metrics": {"i2t_r1": 9.7, "i2t_r5": 26.2}}
    (run / "results.json").write_text(json.dumps(record))
    with pytest.raises(UserInputError, match=r"CCA baseline run.*results\.json \(i2t_r1 9\.7, i2t_r5 26\.2\)"
                                             r".*--model=embedding") as err:
        load_run(run)
    assert "run_config.json" not in str(err.value)
    assert run_results(run, run)["metrics"]["i2t_r1"] == 9.7
