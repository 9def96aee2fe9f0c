"""End-to-end: the deep-fragment-embedding experiment (Karpathy et al. Tables 2-3) on tiny embedded data."""
import json

import numpy as np
import pytest

from tests.support.records import assert_comparable_record
from experiments import common
from experiments import fragments as fe
from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.systems.fragments import pipeline
from tf_twobranch.runs import load_run

TINY = ["--word_dim=8", "--embed_dim=16", "--epochs=4", "--batch_size=20", "--scene_cnn_epochs=1",
        "--verbose=0", "--class_balanced", "--learning_rate=0.001"]


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    # 60 images: the proposal generator stays in-process (no worker pool to start).
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=60,
                                     splits=(40, 5, 15), num_proposals=30)


def row_data(run):
    """The recipe and data of a loaded run (what the draw tool rebuilds)."""
    recipe = pipeline.FragmentRecipe.from_record(run.config)
    return recipe, pipeline.load_data(recipe)


def run_row(cfg, dataset, run_dir, *extra):
    fv = common.parse_flagfile(fe.define_flags, str(common.resolve_config(cfg)),
                               [f"--dataset_dir={dataset}", *TINY, f"--run_dir={run_dir}", *extra])
    return fe.run(fv)


@pytest.fixture(scope="module")
def mil_run(tiny_dataset, tmp_path_factory):
    """The † + MIL row, trained once for the tests of this module (the fine-tuned row tests the export)."""
    run_dir = tmp_path_factory.mktemp("runs") / "mil"
    return run_row("fragments_table2_fragment_global_mil", tiny_dataset, run_dir, "--noexport"), run_dir


def test_every_karpathy_flagfile_parses_with_its_paper_numbers():
    configs = sorted(common.CONFIG_DIR.glob("fragments_table*_*.cfg"))
    assert len(configs) >= 17
    for cfg in configs:
        fv = common.parse_flagfile(fe.define_flags, str(cfg))
        assert fv.row_name and len(common.paper_numbers(fv.paper_results)) == 8, cfg
        assert fv.paper_dataset == ("Flickr8K" if "table2" in cfg.name else "Flickr30K")


def _check_metrics(m):
    for side in ("i2t", "t2i"):
        assert 0 <= m[f"{side}_r1"] <= m[f"{side}_r5"] <= m[f"{side}_r10"] <= 100
        assert m[f"{side}_medr"] >= 1 and m[f"{side}_meanr"] >= 1


def test_mil_row_trains_two_stages_evaluates_and_reloads(mil_run):
    record, run_dir = mil_run
    assert [(s["stage"], s["epochs"], s["mil"]) for s in record["stages"]] == [(1, [0, 2], False), (2, [2, 4], True)]
    _check_metrics(record["metrics"])
    assert record["num_eval_images"] == 15 and record["num_eval_captions"] == 75
    assert record["fragments"]["relation_types_after_filter"] >= 5
    # Grounding of the test phrases through the best-aligned image fragment (evaluation.grounding).
    grounding = record["grounding"]
    assert grounding["rule"] == "best_fragment" and grounding["num_phrases"] > 0
    assert 0 <= grounding["pointing_accuracy"] <= 100 and 0 <= grounding["box_r1"] <= grounding["box_upper_bound"]
    written = json.loads((run_dir / "results.json").read_text())
    assert_comparable_record(written)
    assert written["metrics"] == record["metrics"]
    # The reloaded row scores exactly what the run reported.
    run = load_run(run_dir)
    recipe, data = row_data(run)
    from tf_twobranch.data.formats.row_arrays import ShardedRows
    assert isinstance(data.images["train"].inputs, ShardedRows)          # the cache is read memory-mapped
    again = run.model.evaluate(pipeline.evaluation_split(recipe, data, run.model.config))
    assert again == pytest.approx(record["metrics"])


def test_runner_prints_rows_beside_the_paper_and_random_ranking_is_chance(tiny_dataset, tmp_path, capsys):
    argv = ["prog", f"--dataset_dir={tiny_dataset}", *TINY, f"--runs_dir={tmp_path}", "--table=all",
            "--rows=fragments_table2_random_ranking,fragments_table2_devise,fragments_table3_devise",
            "--epochs=2", "--noexport"]
    f = common.parse_flagfile(fe.define_flags, "/dev/null", argv[1:])
    out = fe.run_rows(f, argv)
    printed = capsys.readouterr().out
    assert "Random Ranking" in printed and "DeViSE" in printed
    # 15 test images are not the paper's Flickr8K 1K split: its numbers are not printed beside them.
    assert "(paper)" not in printed and "protocol flickr8k_1k) are not shown beside a full result" in printed
    rows = out["rows"]
    assert set(rows) == {"fragments_table2_random_ranking", "fragments_table2_devise", "fragments_table3_devise"}
    chance = rows["fragments_table2_random_ranking"]["metrics"]
    assert chance["i2t_r1"] < 40 and chance["t2i_r1"] < 40      # 15 images: R@1 chance is 1/15
    _check_metrics(rows["fragments_table2_devise"]["metrics"])
    saved = json.loads((tmp_path / "fragments_tables.json").read_text())
    assert saved["table2"].startswith("Karpathy") and saved["table3"].startswith("Karpathy")
    # One run-folder rule: <runs_dir>/<flagfile stem>; the flags typed here reach every row.
    for stem in rows:
        assert rows[stem]["run_dir"] == str(tmp_path / stem)
        record = json.loads((tmp_path / stem / "results.json").read_text())
        assert record["typed_flags"]["epochs"] == 2 and record["typed_flags"]["embed_dim"] == 16, stem
    # The Table 3 twin (only the paper's labels differ) shares the Table 2 model: not trained again.
    twin = json.loads((tmp_path / "fragments_table3_devise" / "results.json").read_text())
    assert twin["shared_with"] == "DeViSE" and twin["trained_in"] == str(tmp_path / "fragments_table2_devise")
    assert twin["paper_dataset"] == "Flickr30K" and rows["fragments_table3_devise"]["paper"][0] == 4.5
    assert not (tmp_path / "fragments_table3_devise" / "stage1").exists()
    assert (tmp_path / "fragments_table2_devise" / "stage1").is_dir()
    assert "Next:" in printed
    # Run again: every row is found finished in its folder and not trained again.
    from tf_twobranch import table_runner
    calls = []
    monkey = pytest.MonkeyPatch()
    monkey.setattr(fe.pipeline, "run", lambda *a, **k: calls.append(a) or pytest.fail("trained again"))
    try:
        again = fe.run_rows(f, argv)
    finally:
        monkey.undo()
    assert capsys.readouterr().out.count("finished earlier") == 3 and not calls
    assert again["rows"] == out["rows"]
    assert table_runner.finished_record(tmp_path / "fragments_table2_devise",
                                        json.loads((tmp_path / "fragments_table2_devise" / "table_row.json")
                                                   .read_text())["arguments"])


def test_a_single_flagfile_run_uses_the_run_folder_rule(tiny_dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TF_TWOBRANCH_RUNS", str(tmp_path))
    cfg = str(common.resolve_config("fragments_table2_random_ranking"))
    f = common.parse_flagfile(fe.define_flags, cfg, [f"--dataset_dir={tiny_dataset}", *TINY])
    record = fe.run(f, flagfile=cfg)
    assert record["run_dir"] == str(tmp_path / "fragments_table2_random_ranking")
    assert (tmp_path / "fragments_table2_random_ranking" / "results.json").is_file()


def test_fine_tuned_cnn_trains_the_top_layer_in_the_second_stage_only(tiny_dataset, tmp_path):
    run_dir = tmp_path / "ft"
    record = run_row("fragments_table3_fine_tuned_cnn", tiny_dataset, run_dir, "--epochs=2")
    assert [s["cnn_trained"] for s in record["stages"]] == [False, True]
    run = load_run(run_dir)
    model, images = run.model, row_data(run)[1].images
    folded_kernel, _ = images["train"].head
    assert model.config.image_head_dim == folded_kernel.shape[1]
    assert not np.allclose(model.image_head.get_weights()[0], folded_kernel)
    import h5py
    with h5py.File(run_dir / "stage1" / "checkpoints" / "latest.weights.h5", "r") as h5:
        kernels = []
        h5.visititems(lambda name, obj: kernels.append(np.asarray(obj)) if "image_head" in name
                      and isinstance(obj, h5py.Dataset) and obj.ndim == 2 else None)
    assert kernels and np.allclose(kernels[0], folded_kernel, atol=1e-6)
    # The row's export takes the activation below the CNN's top layer, as the model does.
    import tensorflow as tf

    loaded = tf.saved_model.load(record["export_dir"])
    x = np.asarray(images["test"].inputs[:2], np.float32)
    got = loaded.signatures["embed_image_fragments"](image_fragments=tf.constant(x))["image_fragment_embedding"]
    np.testing.assert_allclose(got.numpy(), model.embed_image_fragments(x).numpy(), atol=1e-4)


def test_sentences_left_without_fragments_are_counted_and_scored(tiny_dataset, tmp_path):
    # Word vectors for a handful of words: most fragments lose a word, many sentences all of them.
    vectors = tmp_path / "few_words.txt"
    rng = np.random.default_rng(0)
    vectors.write_text("".join(f"{w} " + " ".join(f"{x:.3f}" for x in rng.normal(size=8)) + "\n"
                               for w in ("a", "red", "blue", "seven", "two")))
    record = run_row("fragments_table2_fragment_global", tiny_dataset, tmp_path / "r",
                     f"--word_vectors={vectors}", "--epochs=1", "--noexport")
    stats = record["fragments"]
    assert 0 < stats["test_sentences_without_fragments"] < record["num_eval_captions"]
    assert stats["test_fragments_per_sentence"] < 2
    _check_metrics(record["metrics"])


def test_bad_inputs_get_clear_errors(tiny_dataset, tmp_path):
    bad = tmp_path / "frag.npy"
    np.save(bad, np.zeros((5, 20, 4), np.float32))
    with pytest.raises(Exception, match=r"frag\.npy.*5 images of fragment features, expected 40"):
        run_row("fragments_table2_fragment_global", tiny_dataset, tmp_path / "a",
                f"--fragment_features=train={bad},test={bad}")
    with pytest.raises(common.UserInputError, match="split=path"):
        run_row("fragments_table2_fragment_global", tiny_dataset, tmp_path / "b", f"--fragment_features={bad}")
    with pytest.raises(common.UserInputError, match="--parses=.*missing.conllu: file not found"):
        run_row("fragments_table2_fragment_global", tiny_dataset, tmp_path / "c",
                f"--parses={tmp_path / 'missing.conllu'}")
    good = tmp_path / "train.npy"
    np.save(good, np.ones((40, 20, 4), np.float32))
    test = tmp_path / "test.npy"
    np.save(test, np.ones((15, 20, 4), np.float32))
    with pytest.raises(common.UserInputError, match="fine_tune_cnn.*scene_cnn"):
        run_row("fragments_table3_fine_tuned_cnn", tiny_dataset, tmp_path / "d",
                f"--fragment_features=train={good},test={test}")


def test_draw_fragments_writes_the_alignment_picture_of_a_test_image(mil_run, tmp_path):
    from PIL import Image

    from experiments import fragments_draw

    _, run_dir = mil_run
    paths = fragments_draw.draw_fragments(run_dir, tmp_path / "figures", image_indices=[1], top_sentences=3)
    assert len(paths) == 1 and paths[0].parent == tmp_path / "figures"
    assert paths[0].name.startswith("fragments_")                 # named by tool: no overwriting
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[0].stat().st_size > 10_000
    pixels = np.asarray(Image.open(paths[0]).convert("RGB"))
    assert pixels.shape[0] >= 384 and pixels.shape[1] >= 384   # the 96×96 scene upscaled
    assert pixels.reshape(-1, 3).std(axis=0).max() > 10
    assert not list((tmp_path / "figures").glob(".tmp_*"))     # written through a renamed temp file
    with pytest.raises(common.UserInputError, match=r"image index 15 is out of range.*0\.\.14"):
        fragments_draw.draw_fragments(run_dir, tmp_path / "none", image_indices=[15])


def test_best_image_fragments_skips_padding_on_both_sides():
    from tf_twobranch.systems.fragments.alignment import best_image_fragments

    scores = np.array([[0.1, -2.0, 0.3, 9.0],
                       [0.5, -1.0, 0.3, 9.0],
                       [0.2, -3.0, 0.7, 9.0],
                       [9.0, 9.0, 9.0, 9.0]])          # a padded image fragment: never chosen
    best, best_scores = best_image_fragments(scores, np.array([True, True, True, False]),
                                             np.array([True, True, True, False]))
    np.testing.assert_array_equal(best, [1, 1, 2, -1])
    np.testing.assert_allclose(best_scores[:3], [0.5, -1.0, 0.7])
    assert np.isnan(best_scores[3])
    tie, _ = best_image_fragments(np.zeros((3, 2)))
    np.testing.assert_array_equal(tie, [0, 0])       # ties: the whole image (fragment 0)
    with pytest.raises(common.UserInputError, match="masks must be"):
        best_image_fragments(scores, np.ones(3, bool))


def test_draw_fragments_names_what_is_wrong_with_the_run_folder(tmp_path):
    from experiments import fragments_draw

    with pytest.raises(common.UserInputError, match="no results.json"):
        fragments_draw.draw_fragments(tmp_path, tmp_path / "out")
    common.write_json(tmp_path / "results.json", {"row": "Random Ranking", "flags": {}, "stages": []})
    with pytest.raises(common.UserInputError, match="no trained stage"):
        fragments_draw.draw_fragments(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_load_run_rebuilds_the_fragment_model_and_its_split_from_the_run_folder_alone(mil_run):
    record, run_dir = mil_run
    run = load_run(run_dir)
    assert run.family == "fragments" and run.results["metrics"] == record["metrics"]
    assert run.run_dir.name == "stage2" and run.results["stage"] == 2
    assert run.model.evaluate(run.evaluation_split()) == pytest.approx(record["metrics"])


def test_spacy_parser_path_parses_the_captions_once_and_trains(tiny_dataset, tmp_path):
    pytest.importorskip("spacy")
    from test_spacy_parses import saved_chain_parser_pipeline

    saved_chain_parser_pipeline(tmp_path / "pipeline")
    record = run_row("fragments_table2_fragment_global", tiny_dataset, tmp_path / "r", "--parser=spacy",
                     f"--spacy_model={tmp_path / 'pipeline'}", "--epochs=1", "--noexport")
    parses = record["fragments"]["parses"]
    assert parses.startswith(str(tiny_dataset / "features")) and parses.endswith(".conllu")
    assert record["fragments"]["relations"] == ["dep"]          # the chain parser's one label
    _check_metrics(record["metrics"])


def test_feature_dtype_float16_stores_the_fragment_cache_in_half(tiny_dataset, mil_run):
    # After mil_run: the scene CNN and the float32 cache exist; the half cache is another folder.
    def load(*extra):
        fv = common.parse_flagfile(fe.define_flags, str(common.resolve_config("fragments_table2_fragment_global")),
                                   [f"--dataset_dir={tiny_dataset}", *TINY, *extra])
        return pipeline.load_data(fe.recipe_from_flags(fv)[0]).images

    full, half = load(), load("--feature_dtype=float16")
    for split in ("train", "test"):
        assert full[split].inputs.dtype == np.float32 and half[split].inputs.dtype == np.float16
        np.testing.assert_array_equal(half[split].inputs[0:len(half[split].inputs)],
                                      np.asarray(full[split].inputs[0:len(full[split].inputs)]).astype(np.float16))
        np.testing.assert_array_equal(half[split].mask, full[split].mask)


def test_steps_per_epoch_shortens_an_epoch_and_zero_keeps_the_papers(tiny_dataset, tmp_path):
    # The flag that lets a real-size (Flickr30K) trial run a few steps and evaluate.
    short = run_row("fragments_table2_fragment_global", tiny_dataset, tmp_path / "short", "--epochs=1",
                    "--steps_per_epoch=2", "--noexport")
    full = run_row("fragments_table2_fragment_global", tiny_dataset, tmp_path / "full", "--epochs=1",
                   "--noexport")
    iterations = {name: record["stages"][0]["optimizer_steps"] for name, record in (("short", short), ("full", full))}
    assert iterations["short"] == short["stages"][0]["steps_per_epoch"] == 2
    # The paper's epoch: every training sentence once (40 images x 5 captions, batches of 20).
    assert iterations["full"] == full["num_train_images"] * 5 // 20 == 10
    _check_metrics(short["metrics"])
