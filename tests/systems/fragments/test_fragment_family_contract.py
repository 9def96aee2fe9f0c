"""Issue 24, the fragment family on the contract: a typed recipe, `load_run` alone, no experiment imports."""
import ast
import json
import pathlib

import numpy as np
import pytest
from absl import flags

from tests.support.forked_modules import run_python
from experiments import common
from experiments import fragments as fe
from tf_twobranch.data.embedded import generate_embedded_dataset
from tf_twobranch.systems.fragments.pipeline import FragmentRecipe

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
TINY = ["--word_dim=8", "--embed_dim=16", "--epochs=2", "--batch_size=20", "--scene_cnn_epochs=1",
        "--verbose=0", "--class_balanced", "--learning_rate=0.001", "--noexport"]


def test_recipe_fields_are_the_experiments_flags_with_their_defaults():
    fv = flags.FlagValues()
    fe.define_flags(fv)
    assert sorted(FragmentRecipe.field_names()) == sorted(fv)   # the shared run fields come first
    defaults = FragmentRecipe()
    for name in fv:
        assert getattr(defaults, name) == fv[name].default, name


def test_recipe_round_trips_through_json_and_reads_older_flag_records():
    fv = common.parse_flagfile(fe.define_flags, str(common.resolve_config("fragments_table2_fragment_global_mil")),
                               ["--dataset_dir=/d", "--fragment_features=train=a.npy,test=b.npy"])
    recipe, typed = fe.recipe_from_flags(fv)
    assert recipe.mil and recipe.fragment_features == ["train=a.npy", "test=b.npy"] and typed["mil"]
    assert FragmentRecipe.from_record(json.loads(json.dumps({"recipe": recipe.to_dict()}))) == recipe
    # Records written before recipes: their effective flag values (with absl's own flags among them).
    assert FragmentRecipe.from_record({"flags": {**recipe.to_dict(), "logtostderr": False}}) == recipe
    with pytest.raises(Exception, match="unknown FragmentRecipe fields"):
        FragmentRecipe.from_record({"recipe": {"no_such_flag": 1}})


def _imports(path: pathlib.Path) -> set[str]:
    """Every module name an import statement of `path` names (``from a import b``: a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_library_module_imports_experiments_and_draw_fragments_imports_no_experiment():
    offenders = {str(p.relative_to(REPO_ROOT)): sorted(n for n in _imports(p) if n.split(".")[0] == "experiments")
                 for p in (REPO_ROOT / "tf_twobranch").rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}
    draw = _imports(REPO_ROOT / "experiments" / "fragments_draw.py")
    assert not [n for n in draw if n.split(".")[0] == "experiments"]


def test_experiment_module_stays_thin():
    assert len((REPO_ROOT / "experiments" / "fragments.py").read_text().splitlines()) < 300
    assert not hasattr(fe, "load_row")


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory):
    """A † + MIL row (two stages) and a DeViSE row, trained through the experiment on tiny data."""
    dataset = generate_embedded_dataset(tmp_path_factory.mktemp("data") / "scenes", num_images=60,
                                        splits=(40, 5, 15), num_proposals=30)
    runs = tmp_path_factory.mktemp("runs")
    for name, cfg in (("mil", "fragments_table2_fragment_global_mil"), ("devise", "fragments_table2_devise")):
        fv = common.parse_flagfile(fe.define_flags, str(common.resolve_config(cfg)),
                                   [f"--dataset_dir={dataset}", *TINY, f"--run_dir={runs / name}"])
        fe.run(fv)
    return runs


def _check(run, metrics):
    got = run.model.evaluate(run.evaluation_split())
    assert set(got) == set(metrics)
    np.testing.assert_allclose([got[k] for k in sorted(got)], [metrics[k] for k in sorted(metrics)],
                               rtol=1e-6, atol=1e-6)


def test_load_run_alone_evaluates_each_stage_to_its_recorded_metrics(tiny_rows):
    from tf_twobranch.runs import load_run

    record = json.loads((tiny_rows / "mil" / "results.json").read_text())
    assert [s["stage"] for s in record["stages"]] == [1, 2] and record["recipe"]["mil"]
    last = load_run(tiny_rows / "mil")
    assert last.family == "fragments" and last.run_dir.name == "stage2"
    assert last.results["metrics"] == record["metrics"]
    _check(last, last.results["metrics"])
    first = load_run(tiny_rows / "mil" / "stage1")
    assert first.run_dir.name == "stage1" and first.results["stage"] == 1
    assert first.results["metrics"] == record["stages"][0]["metrics"]
    _check(first, first.results["metrics"])
    devise = load_run(tiny_rows / "devise")
    assert devise.model.config.representation == "devise"
    _check(devise, devise.results["metrics"])


def test_load_run_needs_no_experiment_module(tiny_rows):
    # A fresh interpreter (a notebook): tf_twobranch.runs alone, and no experiments module gets imported.
    code = (
        "import sys, json, numpy as np\n"
        "from tf_twobranch.runs import load_run\n"
        f"run = load_run({str(tiny_rows / 'mil')!r})\n"
        "got, want = run.model.evaluate(run.evaluation_split()), run.results['metrics']\n"
        "assert set(got) == set(want)\n"
        "np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-6, atol=1e-6)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'experiments'], 'experiments imported'\n"
        "print('ok')\n")
    proc = run_python(["-c", code], cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
