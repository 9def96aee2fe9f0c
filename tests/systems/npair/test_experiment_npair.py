"""experiments.npair end to end at tiny size: rows, the table runner, pictures."""
import json
import pathlib

import pytest
from absl import flags

from tests.support.records import assert_comparable_record
from experiments import common
from experiments import npair as exp
from tf_twobranch.data.embedded import generate_embedded_dataset

TINY = ["--word_dim=8", "--embed_dim=8", "--epochs=2", "--steps_per_epoch=4", "--batch_size=16",
        "--scene_cnn_epochs=1", "--verbose=0", "--protocol=folds_100", "--run_eagerly"]


def test_every_das_flagfile_parses_with_its_paper_numbers():
    configs = sorted(common.CONFIG_DIR.glob("npair_*.cfg"))
    stems = {c.stem for c in configs}
    assert {"npair_table2_random", "npair_table2_centre", "npair_table2_vgg_channel_mean", "npair_table2_untrained",
            "npair_table2_npair_word", "npair_table2_npair_phrase", "npair_table2_triplet",
            "npair_table1_flickr30k", "npair_table1_mscoco"} <= stems
    for cfg in configs:
        f = common.parse_flagfile(exp.define_flags, str(cfg), [])
        paper = common.paper_numbers(f.paper_results)
        if cfg.stem == "npair_table2_npair_phrase":
            assert paper is None            # the paper prints no number for it
        else:
            assert len(paper) == (6 if "table1" in cfg.stem else 1), cfg.stem
    assert common.parse_flagfile(exp.define_flags, str(common.resolve_config("npair_table2_triplet")),
                                 []).loss == "triplet"


@pytest.fixture(scope="module")
def tiny_tables(tmp_path_factory):
    dataset = generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=145,
                                        splits=(40, 5, 100), with_proposals=False)
    runs = tmp_path_factory.mktemp("runs")
    f = flags.FlagValues()
    exp.define_flags(f)
    argv = ["prog", f"--dataset_dir={dataset}", *TINY, "--rows=npair_table2_random,npair_table2_centre,"
            "npair_table2_vgg_channel_mean,npair_table2_untrained,npair_table2_npair_word,npair_table2_npair_phrase,"
            "npair_table1_flickr30k", f"--runs_dir={runs}", "--noexport"]
    f(argv)
    return dataset, runs, exp.run_rows(f, argv), (f, argv)


def test_runner_prints_table2_and_table1_and_shares_one_model(tiny_tables):
    _, runs, out, _ = tiny_tables
    rows = out["rows"]
    assert "Table 2" in out["table2"] and "Table 1" in out["table1"]
    for stem in ("npair_table2_random", "npair_table2_centre", "npair_table2_npair_word", "npair_table2_npair_phrase"):
        accuracy = rows[stem]["metrics"]["pointing_accuracy"]
        assert 0.0 <= accuracy <= 100.0 and rows[stem]["trials"] > 0
    assert "51.06" in out["table2"] and "27.24" in out["table2"]
    # The Table 1 row evaluates the word-mode model (trained once); the phrase row trains on
    # phrase-parsed captions (the code's parse mode) and is evaluated in phrase mode.
    assert not (runs / "npair_table1_flickr30k" / "checkpoints").exists()
    word = json.loads((runs / "npair_table2_npair_word" / "results.json").read_text())
    phrase = json.loads((runs / "npair_table2_npair_phrase" / "results.json").read_text())
    assert_comparable_record(word), assert_comparable_record(phrase)
    assert len(word["history"]["loss"]) == 2 and len(phrase["history"]["loss"]) == 2
    assert phrase["recipe"]["train_parse_mode"] == "phrase" and word["recipe"]["train_parse_mode"] == "word"
    assert set(word["pointing"]) == {"word", "phrase"}
    assert rows["npair_table2_npair_phrase"]["metrics"]["pointing_accuracy"] == phrase["pointing"]["phrase"]["accuracy"]
    assert rows["npair_table2_npair_word"]["metrics"]["pointing_accuracy"] == word["pointing"]["word"]["accuracy"]
    # Every row's grounding summary (evaluation.grounding) is over the same phrases, by its own point rule.
    centre = json.loads((runs / "npair_table2_centre" / "results.json").read_text())
    assert {r["grounding"]["phrase_fingerprint"] for r in (word, phrase, centre)} == {word["phrase_fingerprint"]}
    assert (word["grounding"]["rule"], centre["grounding"]["rule"]) == ("heat_map", "centre_point")
    assert word["grounding"]["pointing_accuracy"] == word["metrics"]["pointing_accuracy"]
    table1 = rows["npair_table1_flickr30k"]["metrics"]
    assert table1["rsum"] == word["retrieval"]["folds_100"]["rsum"]
    # The untrained model is evaluated like the trained one: retrieval near chance.
    untrained = json.loads((runs / "npair_table2_untrained" / "results.json").read_text())
    assert untrained["history"] == {} and "folds_100" in untrained["retrieval"]
    # One run-folder rule (<runs_dir>/<flagfile stem>), and the flags typed here reached every row.
    for stem, row in rows.items():
        assert row["run_dir"] == str(runs / stem), stem
        record = json.loads((runs / stem / "results.json").read_text())
        assert record["recipe"]["embed_dim"] == 8 and record["recipe"]["batch_size"] == 16, stem
    shared = json.loads((runs / "npair_table1_flickr30k" / "results.json").read_text())
    assert shared["shared_with"] == word["row"] and shared["trained_in"] == str(runs / "npair_table2_npair_word")


def test_a_second_run_of_the_table_reuses_every_row(tiny_tables, monkeypatch, capsys):
    _, runs, out, (f, argv) = tiny_tables
    monkeypatch.setattr(exp, "run", lambda *a, **k: pytest.fail("a finished row was run again"))
    again = exp.run_rows(f, argv)
    assert capsys.readouterr().out.count("finished earlier") == 7
    assert again["rows"] == out["rows"] and again["table2"] == out["table2"] and again["table1"] == out["table1"]


def test_load_run_loads_an_npair_row(tiny_tables):
    # load_run alone gives the trained model back, with the run's test maps (tests/systems/npair/test_npair_family_contract.py
    # checks that its evaluate gives results.json's metrics).
    from tf_twobranch.runs import load_run
    _, runs, _, _ = tiny_tables
    run = load_run(runs / "npair_table2_npair_word")
    split = run.evaluation_split()
    assert run.model.config.embed_dim == 8 and len(split.image) == len(split.image_ids) == 100


def test_heat_map_pictures_from_the_run_folder(tiny_tables, tmp_path):
    from experiments import npair_draw
    _, runs, _, _ = tiny_tables
    paths = npair_draw.draw(runs / "npair_table2_npair_word", tmp_path, [0, 1], parse_mode="phrase")
    assert len(paths) == 2 and all(pathlib.Path(p).stat().st_size > 5000 for p in paths)
    with pytest.raises(common.UserInputError, match="no results.json"):
        npair_draw.draw(tmp_path, tmp_path, [0])


def test_baseline_rows_need_entities_annotations_and_bad_flags_are_clear(tmp_path):
    with pytest.raises(Exception, match="backbone_weights"):
        f = common.parse_flagfile(exp.define_flags, str(common.resolve_config("npair_table2_npair_word")),
                                  ["--image_backbone=vgg19", f"--run_dir={tmp_path}"])
        exp.run(f)
    # The bfloat16 retrieval scorer is S_MaxImage's: another aggregator is refused before any training.
    f = common.parse_flagfile(exp.define_flags, str(common.resolve_config("npair_table2_npair_word")),
                              ["--aggregator=max_text", "--retrieval_score_dtype=bfloat16",
                               f"--run_dir={tmp_path}", "--dataset_dir=/nonexistent"])
    with pytest.raises(common.UserInputError, match="retrieval_score_dtype=bfloat16 needs --aggregator=max_image"):
        exp.run(f)
