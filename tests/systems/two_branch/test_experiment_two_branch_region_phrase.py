"""End-to-end: the phrase-localization experiment (Table 1) and the combined model (Table 5)."""
import json

import pytest

from tests.support.forked_modules import run_python
from tests.support.records import assert_comparable_record
from experiments import two_branch_combined_distance as cr
from experiments import common
from experiments import two_branch_region_phrase as pl
from tf_twobranch.data.embedded import generate_embedded_dataset

TINY = ["--hidden_dim=32", "--embed_dim=16", "--batch_size=20", "--epochs=6", "--constraint_epochs=1",
        "--top_k=3", "--scene_cnn_epochs=1", "--word_dim=8", "--verbose=0", "--cca_components=32",
        "--negatives_per_phrase=5"]


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=80,
                                     splits=(40, 10, 30), num_proposals=30)


def _run(cfg, dataset, run_dir, *extra):
    fv = common.parse_flagfile(pl.define_flags, str(common.resolve_config(cfg)),
                               [f"--dataset_dir={dataset}", *TINY, f"--run_dir={run_dir}", *extra])
    return pl.run(fv)


def test_every_table1_flagfile_parses():
    configs = sorted(common.CONFIG_DIR.glob("two_branch_table1_*.cfg"))
    assert len(configs) >= 12
    for cfg in configs:
        fv = common.parse_flagfile(pl.define_flags, str(cfg))
        assert fv.row_name and 1 <= len(common.paper_numbers(fv.paper_results)) <= 3
    assert common.paper_numbers(common.parse_flagfile(
        pl.define_flags, str(common.resolve_config("two_branch_table1_c5_similarity_1fc_head"))).paper_results) == [36.61]


def test_table5_flagfile_parses():
    fv = common.parse_flagfile(cr.define_flags, str(common.resolve_config("two_branch_table5_weighted_distance")))
    assert fv.alpha == 0.3 and len(common.paper_numbers(fv.paper_results)) == 12


def test_constraints_without_sampling_is_a_clear_error(tiny_dataset, tmp_path):
    with pytest.raises(common.UserInputError, match="neighbourhood_sampling"):
        _run("two_branch_table1_b4_nonlinear_augm_pos_bidir", tiny_dataset, tmp_path / "run",
             "--neighbourhood_constraints")


def _check_metrics(m):
    for key in ("r1", "r5", "r10", "upper_bound"):
        assert 0.0 <= m[key] <= 100.0
    assert m["r1"] <= m["r5"] <= m["r10"] <= m["upper_bound"]
    assert m["per_type"] and all("r1" in v for v in m["per_type"].values())


@pytest.mark.slow
# The similarity network's phrase-localization path is exercised end to end by
# tests/systems/two_branch/test_export_localization.py (a trained similarity row and its export).
@pytest.mark.parametrize("cfg", ["two_branch_table1_b6_nonlinear_augm_pos_bidir_nbr_constraints"])
def test_rows_run_end_to_end(cfg, tiny_dataset, tmp_path):
    record = _run(cfg, tiny_dataset, tmp_path / "run")
    _check_metrics(record["metrics"])
    _beats_random_scores(record)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["metrics"]["r1"] == record["metrics"]["r1"]
    assert_comparable_record(saved)
    assert (tmp_path / "run" / "export" / "saved_model.pb").exists()
    if "b6" in cfg:  # the second stage switched the constraint terms on
        assert [s["name"] for s in record["stages"]] == ["main", "neighbourhood_constraints"]
        config = json.loads((tmp_path / "run" / "run_config.json").read_text())["model"]
        assert config["image_neighbour_weight"] == 0.1
        # Fig. 2 from the fresh run with --run_dir alone: the run recorded its backbone,
        # phrase encoder and dataset.
        out = tmp_path / "pictures"
        done = run_python(["-m", "experiments.two_branch_draw",
                           f"--run_dir={tmp_path / 'run'}", f"--out_dir={out}", "--num_images=2"],
                          cwd=common.REPO_ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        pictures = sorted(out.glob("*.png"))
        assert len(pictures) == 2 and all(p.stat().st_size > 1000 for p in pictures)
        # ... and from the run's own export, which the README's Fig. 2 command names.
        out = tmp_path / "pictures_from_export"
        done = run_python(["-m", "experiments.two_branch_draw",
                           f"--saved_model={tmp_path / 'run' / 'export'}", f"--out_dir={out}",
                           "--num_images=2"],
                          cwd=common.REPO_ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(sorted(out.glob("*.png"))) == 2
        from tf_twobranch.errors import UserInputError
        from tf_twobranch.runs import load_run
        with pytest.raises(UserInputError, match="phrase-localization run has no retrieval split"):
            load_run(tmp_path / "run").evaluation_split()
    table = pl.format_localization_table("t", [pl._table_row(record)])
    assert "R@1" in table and "paper R@1" in table


def _beats_random_scores(record):
    """The trained model beats random proposal scores on the same phrases by 2 standard errors."""
    chance = record["random_baseline"]
    assert 0 < chance["r1"] < chance["upper_bound"]
    p, n = chance["r1"] / 100.0, chance["num_phrases"]
    bar = chance["r1"] + 200.0 * (p * (1 - p) / n) ** 0.5
    print(record["row"], "R@1", record["metrics"]["r1"], "random", chance["r1"], "bar", bar)
    assert record["metrics"]["r1"] > bar
    assert record["metrics"]["r5"] > chance["r5"]


def test_cca_row_runs(tiny_dataset, tmp_path):
    record = _run("two_branch_table1_a_cca", tiny_dataset, tmp_path / "run")
    _check_metrics(record["metrics"])
    _beats_random_scores(record)
    # Grounding (evaluation.grounding): the pointing game of the top proposal's centre on the
    # same phrases as R@K, whose R@1 is the box R@1.
    grounding = record["grounding"]
    assert grounding["rule"] == "top_proposal" and grounding["num_phrases"] == record["num_test_phrases"]
    assert grounding["box_r1"] == record["metrics"]["r1"] and 0 <= grounding["pointing_accuracy"] <= 100
    assert grounding["pointing"]["trials"] == record["num_test_phrases"]


@pytest.mark.slow
def test_combined_model_end_to_end(tiny_dataset, tmp_path):
    from experiments import two_branch_retrieval as isr
    is_fv = common.parse_flagfile(isr.define_flags, str(common.resolve_config(cr.DEFAULT_IMAGE_SENTENCE_CFG)),
                                  [f"--dataset_dir={tiny_dataset}", "--hidden_dim=32", "--embed_dim=16",
                                   "--batch_size=20", "--epochs=1", "--top_k=3", "--scene_cnn_epochs=1",
                                   "--word_dim=8", "--verbose=0", "--export=false",
                                   f"--run_dir={tmp_path / 'is'}"])
    isr.run(is_fv)
    _run(cr.DEFAULT_REGION_PHRASE_CFG, tiny_dataset, tmp_path / "rp", "--export=false")
    fv = common.parse_flagfile(cr.define_flags, str(common.resolve_config("two_branch_table5_weighted_distance")),
                               [f"--image_sentence_run={tmp_path / 'is'}", f"--region_phrase_run={tmp_path / 'rp'}",
                                f"--run_dir={tmp_path / 'combined'}", "--chunk_size=40"])
    record = cr.run(fv)
    assert_comparable_record(record)
    for name in ("image_sentence", "weighted_distance"):
        for key in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10"):
            assert 0.0 <= record[name][key] <= 100.0
    assert record["num_test_captions"] == 5 * record["num_test_images"]
    assert record["num_unique_phrases"] > 0
    assert "Weighted distance" in cr.format_table(record)
