"""Issue 24 for the N-pair family: a typed recipe, the run loaded by `load_run` alone, evaluate == results.json."""
import ast
import dataclasses
import json
import pathlib

import numpy as np
import pytest
from absl import flags

from tests.support.forked_modules import run_python
from experiments import common
from experiments import npair as exp
from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.errors import UserInputError
from tf_twobranch.systems.npair.pipeline import NPairRecipe

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
TINY = ["--word_dim=8", "--embed_dim=8", "--epochs=1", "--steps_per_epoch=3", "--batch_size=16",
        "--scene_cnn_epochs=1", "--verbose=0", "--protocol=folds_100", "--run_eagerly", "--noexport"]
RETRIEVAL_KEYS = {"i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr", "rsum"}


def test_recipe_fields_are_the_experiments_flags_with_their_defaults():
    fv = flags.FlagValues()
    exp.define_flags(fv)
    fv(["prog"])
    names = [name for name in fv]
    assert sorted(NPairRecipe.field_names()) == sorted(names)   # the shared run fields come first
    defaults = NPairRecipe()
    for name in names:
        want = fv[name].default
        assert getattr(defaults, name) == (tuple(want) if isinstance(want, list) else want), name
    # Round trip through the JSON record, and from the flags.
    recipe = NPairRecipe.from_flags(fv)
    assert recipe == defaults
    assert NPairRecipe.from_record(json.loads(json.dumps({"recipe": recipe.to_dict()}))) == recipe
    with pytest.raises(Exception, match="unknown NPairRecipe fields"):
        NPairRecipe.from_dict({"no_such_flag": 1})


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_draw_heat_maps_and_the_pipeline_import_no_experiment():
    for path in (REPO_ROOT / "experiments" / "npair_draw.py",
                 *(REPO_ROOT / "tf_twobranch" / "systems").glob("*/pipeline.py")):
        found = sorted(m for m in _imports(path) if m == "experiments" or m.startswith("experiments."))
        assert not found, f"{path.name} imports {found}"
    source = (REPO_ROOT / "tf_twobranch" / "systems" / "npair" / "pipeline.py").read_text(encoding="utf-8")
    assert "DEFINE_" not in source


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    dataset = generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=145,
                                        splits=(40, 5, 100), with_proposals=False)
    runs = tmp_path_factory.mktemp("runs")
    out = {}
    for name, cfg in (("word", "npair_table2_npair_word"), ("untrained", "npair_table2_untrained"),
                      ("centre", "npair_table2_centre")):
        row = common.parse_flagfile(exp.define_flags, str(common.resolve_config(cfg)),
                                    [f"--dataset_dir={dataset}", *TINY, f"--run_dir={runs / name}"])
        record = exp.run(row)
        out[name] = (runs / name, record)
    return out


def _check_metrics(got: dict, recorded: dict) -> None:
    assert RETRIEVAL_KEYS <= set(got) and RETRIEVAL_KEYS <= set(recorded)
    shared = sorted(set(got) & set(recorded))
    assert "pointing_accuracy" in shared and "rsum_fold_std" in shared
    np.testing.assert_allclose([got[k] for k in shared], [recorded[k] for k in shared], rtol=0, atol=1e-6)


def test_results_record_the_recipe(tiny_runs):
    run_dir, record = tiny_runs["word"]
    saved = json.loads((run_dir / "results.json").read_text())
    recipe = NPairRecipe.from_record(saved)
    assert recipe.embed_dim == 8 and recipe.loss == "npair" and recipe.run_dir == str(run_dir)
    assert saved["typed_flags"]["embed_dim"] == 8 and "word_dim" in saved["typed_flags"]
    assert saved["metrics"] == record["metrics"]


@pytest.mark.parametrize("name", ["word", "untrained"])
def test_load_run_alone_evaluates_to_the_recorded_metrics(tiny_runs, name):
    from tf_twobranch.runs import load_run
    run_dir, _ = tiny_runs[name]
    run = load_run(run_dir)
    assert run.family == "npair" and run.model.config.embed_dim == 8
    split = run.evaluation_split()
    assert split.image.shape[0] == 100 and split.text.shape == split.token_mask.shape
    assert split.protocol == "folds_100" and split.queries
    _check_metrics(run.model.evaluate(split), run.results["metrics"])


def test_load_run_without_absl_or_experiments_in_a_fresh_process(tiny_runs):
    run_dir, _ = tiny_runs["word"]
    code = f"""
import json, sys
from tf_twobranch.runs import load_run
run = load_run({str(run_dir)!r})
metrics = run.model.evaluate(run.evaluation_split())
assert not [m for m in sys.modules if m == "experiments" or m.startswith("experiments.")]
print(json.dumps(metrics))
"""
    proc = run_python(["-c", code], cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    _check_metrics(got, json.loads((run_dir / "results.json").read_text())["metrics"])


def test_a_pointing_baseline_row_has_no_model_to_load(tiny_runs):
    from tf_twobranch.runs import load_run
    run_dir, record = tiny_runs["centre"]
    assert record["row_kind"] == "centre_point" and "pointing_accuracy" in record["metrics"]
    with pytest.raises(UserInputError, match=r"pointing-baseline row \(row_kind=centre_point\) has no model"):
        load_run(run_dir)


def test_evaluate_takes_another_protocol_and_refuses_a_plain_split(tiny_runs):
    from tf_twobranch.evaluation.split import EvaluationSplit
    from tf_twobranch.runs import load_run
    run = load_run(tiny_runs["word"][0])
    split = run.evaluation_split()
    full = run.model.evaluate(split, protocol="full")
    assert RETRIEVAL_KEYS <= set(full) and "rsum_fold_std" not in full and "pointing_accuracy" in full
    no_pointing = run.model.evaluate(dataclasses.replace(split, queries=None))
    assert "pointing_accuracy" not in no_pointing
    with pytest.raises(UserInputError, match="NPairEvaluationSplit"):
        run.model.evaluate(EvaluationSplit(split.image, split.text, split.caption_image))
