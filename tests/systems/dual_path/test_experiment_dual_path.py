"""experiments.dual_path: flagfiles, user errors, and one tiny end-to-end run."""
import json
import pathlib

import numpy as np
import pytest
from absl import flags

from tests.support.forked_modules import run_python
from tests.support.records import assert_comparable_record
from experiments import common
from experiments import dual_path as exp
from tf_twobranch.systems.dual_path import pipeline

CONFIGS = sorted(common.CONFIG_DIR.glob("dual_path_*.cfg"))
TINY = ["--max_train_images=32", "--max_test_images=12", "--stage1_epochs=1",
        "--stage2_epochs=1", "--text_width=2", "--text_blocks=1,1,1,1",
        "--hidden_dim=16", "--embed_dim=16", "--word_dim=8", "--verbose=0", "--batch_size=16",
        "--run_eagerly"]


def _flags(*argv, flagfile=None):
    if flagfile:
        return common.parse_flagfile(exp.define_flags, str(flagfile), argv)
    fv = flags.FlagValues()
    exp.define_flags(fv)
    fv(["prog", *argv])
    return fv


def test_every_paper_table_has_flagfiles():
    names = {p.stem for p in CONFIGS}
    for table in ("table1", "table2", "table5", "table6", "table7", "table8"):
        assert any(table in n for n in names), table
    assert "dual_path_reference_code_flickr30k" in names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_flagfiles_parse_and_carry_paper_numbers(path):
    f = _flags(flagfile=path)
    paper = common.paper_numbers(f.paper_results)
    assert paper and len(paper) in (3, 6)
    assert f.row_name
    pipeline._stages(f.stages)
    pipeline._lambdas(f.stage1_lambdas, "stage1_lambdas")


def test_unknown_flag_in_a_flagfile_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.cfg"
    bad.write_text("--stages=1\n--no_such_flag=3\n")
    with pytest.raises(common.UserInputError, match="bad.cfg"):
        _flags(flagfile=bad)


def test_bad_lambdas_and_stages_are_clear_errors():
    with pytest.raises(common.UserInputError, match="three numbers"):
        pipeline._lambdas(["1", "x", "1"], "stage2_lambdas")
    with pytest.raises(common.UserInputError, match="--stages"):
        pipeline._stages(["3"])


def test_word2vec_init_on_user_data_needs_a_local_file(tmp_path):
    f = _flags(f"--dataset_dir={tmp_path}", "--word_init=word2vec")
    with pytest.raises(common.UserInputError, match="--word_vectors"):
        exp.load_data(f, tmp_path / "run")


@pytest.mark.parametrize("kind", ["retrieval", "pedes"])
def test_missing_dataset_dir_is_reported_before_word_vectors_and_weights(tmp_path, kind):
    missing = tmp_path / "no_such_dataset"
    for extra in ([], ["--word_vectors=/also/missing.bin", "--image_weights=/missing.h5"]):
        f = _flags(f"--dataset_dir={missing}", f"--dataset_kind={kind}", *extra)
        with pytest.raises(common.UserInputError, match=f"--dataset_dir={missing}: dataset folder does not exist"):
            exp.run(f)
        with pytest.raises(common.UserInputError, match="dataset folder does not exist"):
            exp.load_data(f, tmp_path / "run")
    a_file = tmp_path / "reid_raw.json"
    a_file.write_text("[]")
    if kind == "retrieval":
        with pytest.raises(common.UserInputError, match="is not a folder"):
            exp.check_dataset_dir(_flags(f"--dataset_dir={a_file}"))
    else:   # CUHK-PEDES takes the folder of reid_raw.json or the file itself
        exp.check_dataset_dir(_flags(f"--dataset_dir={a_file}", "--dataset_kind=pedes"))


def test_missing_dataset_dir_command_line_error():

    result = run_python(
        ["-m", "experiments.dual_path", "--dataset_dir=/nonexistent",
         "--word_vectors=/also/missing.bin"],
        cwd=common.REPO_ROOT, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: --dataset_dir=/nonexistent: dataset folder does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert "word2vec" not in result.stderr and "missing.bin" not in result.stderr


@pytest.mark.slow
def test_class_count_not_matching_the_data_is_a_clear_error(tmp_path):
    f = _flags(*TINY, "--num_classes=7", f"--run_dir={tmp_path}")
    with pytest.raises(Exception, match="7"):
        exp.run(f)


@pytest.mark.slow
def test_tiny_two_stage_run_evaluates_plots_and_exports(tmp_path):
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (tokenizer ops of the SavedModel)

    from tf_twobranch.data.text_codes import encode_captions
    from tf_twobranch.systems.dual_path.export import embed_with_keras
    from tf_twobranch.systems.dual_path.model import load_dual_path_model

    f = _flags(*TINY, f"--run_dir={tmp_path}")
    record = exp.run(f)
    assert [s["stage"] for s in record["stages"]] == [1, 2]
    for stage in record["stages"]:
        m = stage["metrics"]
        assert 0 <= m["i2t_r1"] <= 100 and 0 <= m["separability_S"] <= 1
        print(f"stage {stage['stage']}: rsum {m['rsum']:.1f}, random {m['random_baseline']['rsum']:.1f}")
    # The chance row is the core's random baseline on the same split and protocol. (At this
    # size -- 32 images, a few steps -- the dual path does not learn yet; BUILD_NOTES.md.)
    last = record["stages"][-1]["metrics"]
    chance = last["random_baseline"]
    assert {k for k in last if k.startswith(("i2t_", "t2i_"))} <= set(chance)
    assert 0.0 <= chance["rsum"] <= 600.0 and "chance (random embeddings" in exp.format_record(record)
    for stage in record["stages"]:
        assert (pathlib.Path(stage["run_dir"]) / "similarity_histogram.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert_comparable_record(saved)
    assert saved["stages"][1]["lambdas"] == [1.0, 1.0, 1.0]
    assert "Stage 2" in exp.format_record(record)

    # The SavedModel (JPEG bytes and raw strings in) equals the Keras towers.
    stage2 = tmp_path / "stage2"
    model = load_dual_path_model(stage2 / "dual_path_config.json",
                                 stage2 / "checkpoints" / "latest.weights.h5")
    vocabulary = json.loads((stage2 / "dual_path_config.json").read_text())["vocabulary"]
    from tf_twobranch.runs import load_run
    run = load_run(tmp_path)  # the run folder alone: its last stage, config and results
    assert (run.family, run.run_dir, run.config["stage"]) == ("dual_path", stage2, 2)
    assert run.results["stages"][1]["metrics"]["rsum"] == record["stages"][1]["metrics"]["rsum"]
    # load_run gives the split the run was evaluated on; evaluate reproduces its metrics.
    evaluated = run.model.evaluate(run.evaluation_split())
    assert set(evaluated) < set(record["metrics"])
    assert evaluated == {k: record["metrics"][k] for k in evaluated}
    from tf_twobranch.data.embedded import load_embedded_dataset
    images = sorted((load_embedded_dataset() / "images").glob("*.jpg"))[:3]
    jpegs = [p.read_bytes() for p in images]
    captions = ["a red seven", "two blue digits on the left"]
    codes = np.zeros((2, model.config.max_len), np.int32)
    for i, c in enumerate(encode_captions(captions, vocabulary)):
        codes[i, :len(c)] = c
    want_images, want_texts = embed_with_keras(model, jpegs, codes)
    np.testing.assert_array_equal(embed_with_keras(run.model, jpegs, codes)[1], want_texts)
    loaded = tf.saved_model.load(record["export_dir"])
    got_images = loaded.signatures["embed_images"](image_jpeg=tf.constant(jpegs))
    got_texts = loaded.signatures["embed_texts"](captions=tf.constant(captions))
    np.testing.assert_allclose(got_images["image_embedding"], want_images, atol=1e-4)
    np.testing.assert_allclose(got_texts["text_embedding"], want_texts, atol=1e-4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="no word of the model"):
        loaded.signatures["embed_texts"](captions=tf.constant(["zzzz qqqq"]))
    too_long = " ".join(["red"] * (model.config.max_len + 1))
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_len"):
        loaded.signatures["embed_texts"](captions=tf.constant([too_long]))
