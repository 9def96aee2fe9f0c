"""A fifth system costs one folder (issue 40): `tests/fifth_system/` registers and runs, at smoke
size, through its experiment, `load_run`, `export_run` and the leaderboard, with no change to any
file outside that folder."""
import json

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from experiments import common, leaderboard
from tf_twobranch import systems
from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.export import serving
from tf_twobranch.run_export import export_run
from tf_twobranch.runs import load_run

from tests.fifth_system import experiment
from tests.fifth_system.system import FLAGFILE, SYSTEM
from tests.support.system_contract import check_system_contract


@pytest.fixture(scope="module")
def registered():
    systems.register(SYSTEM)
    yield SYSTEM
    systems.unregister(SYSTEM.name)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=60,
                                     splits=(40, 5, 15), with_entities=False, with_proposals=False)


@pytest.fixture(scope="module")
def row(registered, dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "mean_vectors"
    fv = common.parse_flagfile(experiment.define_flags, FLAGFILE,
                               [f"--dataset_dir={dataset}", f"--run_dir={run_dir}", "--noexport"])
    return run_dir, experiment.run(fv)


def test_registering_is_all_it_takes(registered):
    assert systems.get("mean_vectors") is SYSTEM
    assert systems.for_task("mean_vectors") is SYSTEM
    assert "mean_vectors" in [line.key for line in systems.leaderboard_lines()]


def test_its_row_runs_and_load_run_evaluates_to_its_results(row):
    run_dir, record = row
    assert record["metrics"]["rsum"] > 0 and record["test_split_fingerprint"]
    run = load_run(run_dir)
    assert run.family == "mean_vectors" and type(run.model).__name__ == "MeanVectorModel"
    again = run.model.evaluate(run.evaluation_split())
    saved = json.loads((run_dir / "results.json").read_text())["metrics"]
    assert again == pytest.approx(saved, abs=1e-9)


def test_export_run_writes_a_servable_model_with_its_gallery(row, tmp_path):
    run_dir, record = row
    export_dir = export_run(run_dir, tmp_path / "export")
    loaded = tf.saved_model.load(str(export_dir))
    assert {"score", "embed_images", "embed_texts", "retrieve_captions", "retrieve_images"} <= set(loaded.signatures)
    out = serving.call_signature(loaded, "retrieve_images", captions=tf.constant(["a red square"]),
                                 k=tf.constant(3))
    assert out["image_ids"].shape == (1, 3)
    assert (export_dir / "assets.extra" / "tf_serving_warmup_requests").is_file()
    with pytest.raises(Exception, match="captions"):
        serving.call_signature(loaded, "embed_texts", captions=tf.constant([""]))


def test_it_keeps_the_contract_every_system_keeps(registered, dataset, tmp_path):
    check_system_contract(SYSTEM, dataset, tmp_path)


def test_the_leaderboard_compares_it(registered, dataset, tmp_path):
    fv = flags.FlagValues()
    leaderboard.define_flags(fv)
    fv(["prog", f"--dataset_dir={dataset}", "--seeds=1", f"--runs_dir={tmp_path}", "--systems=mean_vectors",
        "--noorderings", "--nogrounding"])
    result = leaderboard.run_leaderboard(fv)
    rows = {r["key"]: r for r in result["board"]["rows"]}
    assert list(rows) == ["mean_vectors"] and not rows["mean_vectors"]["missing"]
    assert rows["mean_vectors"]["cells"]["rsum"]["mean"] > 0
    assert "Mean word vectors (fifth system)" in result["table"]


def test_conventions_list_every_file_the_fifth_system_needed():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    conventions = (root / "docs" / "CONVENTIONS.md").read_text(encoding="utf-8")
    files = sorted(p.name for p in (root / "tests" / "fifth_system").iterdir()
                   if p.is_file() and p.name != "__init__.py")
    assert files and all(f"`{name}`" in conventions for name in files), files

