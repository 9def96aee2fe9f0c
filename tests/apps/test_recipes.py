"""Issue 24 (items 2-4): recipes equal their experiments' flags; --smoke; the one table runner and
run-folder rule; the one dataset-from-flags helper. Fast (no training)."""
import json
import pathlib

import pytest
from absl import flags

from experiments import common
from experiments import two_branch_retrieval as isr
from experiments import dual_path
from experiments import two_branch_region_phrase as pl
from tf_twobranch import recipes, table_runner
from tf_twobranch.data.from_flags import cut_splits, dataset_folder, split_limit
from tf_twobranch.errors import UserInputError
from tf_twobranch.systems.dual_path.pipeline import DualPathRecipe
from tf_twobranch.systems.two_branch.region_phrase_pipeline import LocalizationRecipe
from tf_twobranch.systems.two_branch.pipeline import RetrievalRecipe

EXPERIMENTS = [(isr, RetrievalRecipe), (pl, LocalizationRecipe), (dual_path, DualPathRecipe)]


@pytest.mark.parametrize("module,cls", EXPERIMENTS, ids=[m.__name__ for m, _ in EXPERIMENTS])
def test_every_recipe_field_is_a_flag_of_its_experiment_and_back(module, cls):
    fv = flags.FlagValues()
    module.define_flags(fv)
    assert cls.flag_names() == set(fv), (cls.flag_names() ^ set(fv))
    fv(["x"])
    recipe = recipes.from_flags(cls, fv)
    # The recipe's defaults are the flags' defaults: a notebook recipe equals the flags' one.
    assert recipe == cls()
    assert recipes.as_record(recipe)["type"] == cls.__name__
    # Its --smoke caps name fields of the recipe, and its --smoke help lists them.
    assert cls.SMOKE_CAPS and set(cls.SMOKE_CAPS) <= cls.flag_names()
    assert all(f"--{name}<={cap}" in fv["smoke"].help for name, cap in cls.SMOKE_CAPS.items())


def test_smoke_caps_only_shorten_and_zero_means_all_gets_the_cap():
    r = LocalizationRecipe(smoke=True, epochs=8, constraint_epochs=2, hard_negative_epochs=0,
                           max_train_images=0, max_test_images=10, max_proposals=200)
    capped, changed = recipes.apply_smoke(r)
    assert (capped.epochs, capped.constraint_epochs, capped.hard_negative_epochs) == (1, 1, 0)
    assert (capped.max_train_images, capped.max_test_images, capped.max_proposals) == (40, 10, 20)
    assert "hard_negative_epochs" not in changed and "max_test_images" not in changed
    assert recipes.apply_smoke(r.replace(smoke=False)) == (r.replace(smoke=False), {})
    d = recipes.apply_smoke(DualPathRecipe(smoke=True))[0]
    assert (d.stage1_epochs, d.stage2_epochs, d.max_train_images) == (1, 1, 32)


def test_a_recipe_without_smoke_caps_refuses_smoke_instead_of_running_full_length():
    import dataclasses

    @dataclasses.dataclass
    class Uncapped(recipes.RunRecipe):
        epochs: int = recipes.flag(10, "Epochs.")

    assert recipes.apply_smoke(Uncapped()) == (Uncapped(), {})
    with pytest.raises(recipes.ConfigError, match="SMOKE_CAPS"):
        recipes.apply_smoke(Uncapped(smoke=True))


def test_the_embedded_profile_fills_only_untyped_fields_and_not_on_a_dataset_folder():
    r, applied = recipes.apply_profile(RetrievalRecipe(epochs=3), {"epochs": 3}, {"epochs": 10, "top_k": 50})
    assert (r.epochs, r.top_k, applied) == (3, 50, {"top_k": 50})
    r, applied = recipes.apply_profile(RetrievalRecipe(dataset_dir="/d"), {}, {"top_k": 50})
    assert r.top_k == 10 and applied == {}


def test_one_run_folder_rule_for_single_runs_and_tables(tmp_path):
    cfg = common.CONFIG_DIR / "two_branch_table2_b6_nonlinear_bidir_nbr_constraints.cfg"
    assert table_runner.run_folder(None, cfg) == common.REPO_ROOT / "runs" / cfg.stem
    assert table_runner.run_folder(tmp_path, str(cfg)) == tmp_path / cfg.stem
    assert table_runner.run_folder(tmp_path, None, "Embedding: linear") == tmp_path / "embedding_linear"
    argv = ["x", "--epochs=1", f"--flagfile={cfg}", "--smoke"]
    assert table_runner.flagfile_of(argv) == str(cfg)
    assert table_runner.flagfile_of(["x", "--flagfile", "a.cfg"]) == "a.cfg"
    assert table_runner.flagfile_of(["x"]) is None


def test_row_arguments_leave_out_the_runners_own_flags():
    argv = ["--rows=all", "--epochs=2", "--noresume", "--smoke", "--runs_dir=/r", "--nolinear"]
    assert table_runner.row_arguments(argv, ["rows", "resume", "runs_dir"]) == ["--epochs=2", "--smoke",
                                                                                "--nolinear"]


def test_select_rows():
    every = table_runner.select_rows(["all"], pattern="two_branch_table1_*.cfg")
    assert every and all(p.name.startswith("two_branch_table1_") for p in every)
    assert table_runner.select_rows(["two_branch_table1_a_cca"], pattern="x") == [common.CONFIG_DIR / "two_branch_table1_a_cca.cfg"]
    with pytest.raises(UserInputError, match="not found"):
        table_runner.select_rows(["no_such_row"], pattern="x")


def test_an_interrupted_table_resumes_with_the_finished_rows_reused(tmp_path):
    configs = [common.CONFIG_DIR / "two_branch_table1_a_cca.cfg", common.CONFIG_DIR / "two_branch_table1_b1_linear_single_pos_single_dir.cfg"]
    calls = []

    def run_row(cfg, arguments):
        calls.append((cfg.stem, arguments))
        run_dir = pathlib.Path(arguments[-1].split("=", 1)[1])
        if cfg.stem.startswith("two_branch_table1_b1") and len(calls) == 2:
            raise KeyboardInterrupt   # the table is interrupted in its second row
        record = {"row": cfg.stem, "run_dir": str(run_dir)}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps(record))
        return record

    kw = dict(overrides=["--epochs=1", "--run_dir=/ignored", "--out_json=/table.json"], runs_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        table_runner.run_table(configs, run_row, **kw)
    assert calls[0][1] == ["--epochs=1", f"--run_dir={tmp_path / configs[0].stem}"]
    records = table_runner.run_table(configs, run_row, **kw)
    assert [c[0] for c in calls] == [configs[0].stem, configs[1].stem, configs[1].stem]   # row 1 reused
    assert [r["row"] for r in records] == [c.stem for c in configs]
    # Other arguments: the row runs again; --noresume: every row runs again.
    table_runner.run_table(configs[:1], run_row, overrides=["--epochs=2"], runs_dir=tmp_path)
    table_runner.run_table(configs[:1], run_row, overrides=["--epochs=2"], runs_dir=tmp_path, resume=False)
    assert len(calls) == 5


def test_rows_of_one_share_key_share_the_first_run_and_resume(tmp_path):
    configs = [common.CONFIG_DIR / f"{stem}.cfg" for stem in
               ("fragments_table2_devise", "fragments_table3_devise", "fragments_table2_bow")]
    calls = []

    def write(cfg, arguments, record):
        run_dir = pathlib.Path(arguments[-1].split("=", 1)[1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps(record))
        return record

    def run_row(cfg, arguments):
        calls.append(("run", cfg.stem))
        return write(cfg, arguments, {"row": cfg.stem, "trained_by": cfg.stem})

    def share(cfg, arguments, first):
        calls.append(("share", cfg.stem))
        return write(cfg, arguments, {**first, "row": cfg.stem})

    kw = dict(runs_dir=tmp_path, share=share, share_key=lambda cfg, arguments: cfg.stem.split("_", 2)[2])
    records = table_runner.run_table(configs, run_row, **kw)
    assert calls == [("run", "fragments_table2_devise"), ("share", "fragments_table3_devise"),
                     ("run", "fragments_table2_bow")]
    assert [(r["row"], r["trained_by"]) for r in records] == [
        ("fragments_table2_devise", "fragments_table2_devise"), ("fragments_table3_devise", "fragments_table2_devise"),
        ("fragments_table2_bow", "fragments_table2_bow")]
    assert all((tmp_path / c.stem / table_runner.ROW_RECORD).is_file() for c in configs)
    # Again: every row (the sharing one too) is reused from its own folder.
    assert table_runner.run_table(configs, run_row, **kw) == records and len(calls) == 3
    # A twin that must run again shares the reused first row's record.
    (tmp_path / "fragments_table3_devise" / "results.json").unlink()
    table_runner.run_table(configs[:2], run_row, **kw)
    assert calls[3:] == [("share", "fragments_table3_devise")]


def test_dataset_from_flags_checks_the_folder_and_cuts_splits(tmp_path):
    missing = tmp_path / "no_such"
    with pytest.raises(UserInputError, match=f"--dataset_dir={missing}: dataset folder does not exist"):
        dataset_folder(str(missing))
    a_file = tmp_path / "f.json"
    a_file.write_text("{}")
    with pytest.raises(UserInputError, match="--data_dir=.*is not a folder"):
        dataset_folder(a_file, flag="--data_dir")
    assert dataset_folder(a_file, allow_file=True) == a_file
    assert dataset_folder(tmp_path) == tmp_path
    assert split_limit("train", 5, 3) == 5 and split_limit("val", 5, 3) == 3 and split_limit("test") is None

    class Corpus:
        def __init__(self, ids):
            self.image_ids, self.source = ids, "s"

        def subset(self, ids, source):
            return Corpus(list(ids))

    cut = cut_splits({"train": Corpus(list("abcdef")), "test": Corpus(list("xyz"))}, ("train", "test"),
                     max_train_images=2)
    assert cut["train"].image_ids == ["a", "b"] and cut["test"].image_ids == list("xyz")


# The row experiments: flags (generated from the recipe) -> recipe -> the system's pipeline `run`.
ROW_EXPERIMENTS = {"two_branch_retrieval": "tf_twobranch.systems.two_branch.pipeline:RetrievalRecipe",
                   "two_branch_region_phrase": "tf_twobranch.systems.two_branch.region_phrase_pipeline:LocalizationRecipe",
                   "dual_path": "tf_twobranch.systems.dual_path.pipeline:DualPathRecipe",
                   "fragments": "tf_twobranch.systems.fragments.pipeline:FragmentRecipe",
                   "npair": "tf_twobranch.systems.npair.pipeline:NPairRecipe"}


def test_experiment_modules_are_thin():
    modules = sorted((common.REPO_ROOT / "experiments").glob("*.py"))
    assert len(modules) >= 16
    for path in modules:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= 150, (path.name, lines)   # issue 40: flags -> recipe -> the system's code


@pytest.mark.parametrize("experiment", sorted(ROW_EXPERIMENTS))
def test_a_recipe_field_and_its_flag_are_declared_once(experiment):
    """Each flag of a row experiment is a field of its recipe, declared with `recipes.flag`, and
    the experiment defines none by hand: `define_recipe_flags` makes them."""
    import ast
    import dataclasses
    import importlib

    module_name, cls_name = ROW_EXPERIMENTS[experiment].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    assert all("flag" in f.metadata for f in dataclasses.fields(cls)), cls_name
    fv = flags.FlagValues()
    importlib.import_module(f"experiments.{experiment}").define_flags(fv)
    assert set(fv) == {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        assert (tuple(fv[f.name].default) if isinstance(fv[f.name].default, list) else fv[f.name].default) == \
            (tuple(default) if isinstance(default, (list, tuple)) else default), f.name
    source = (common.REPO_ROOT / "experiments" / f"{experiment}.py").read_text(encoding="utf-8")
    calls = [n.func.attr for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.startswith("DEFINE")]
    assert not calls, (experiment, calls)


@pytest.mark.parametrize("cls,per_image", [("FragmentRecipe", 1), ("NPairRecipe", 1), ("RetrievalRecipe", 5)])
def test_smoke_caps_a_batch_with_the_images_it_is_drawn_from(cls, per_image):
    """A batch of distinct images (captions) cannot exceed the smoke slice: the fragment and
    N-pair flagfiles' batches of 100 and 64 failed against 40 training images."""
    import importlib
    module = {"FragmentRecipe": "fragments.pipeline", "NPairRecipe": "npair.pipeline",
              "RetrievalRecipe": "two_branch.pipeline"}[cls]
    recipe_cls = getattr(importlib.import_module(f"tf_twobranch.systems.{module}"), cls)
    for batch_size in (recipe_cls().batch_size, 1000):
        capped, _ = recipes.apply_smoke(recipe_cls(smoke=True, batch_size=batch_size))
        assert capped.batch_size <= capped.max_train_images * per_image


def test_smoke_trains_the_scene_cnn_briefly_for_every_family_that_has_one():
    import importlib
    for module, cls in [("two_branch.pipeline", "RetrievalRecipe"),
                        ("two_branch.region_phrase_pipeline", "LocalizationRecipe"),
                        ("fragments.pipeline", "FragmentRecipe"), ("npair.pipeline", "NPairRecipe")]:
        recipe_cls = getattr(importlib.import_module(f"tf_twobranch.systems.{module}"), cls)
        capped, _ = recipes.apply_smoke(recipe_cls(smoke=True))
        assert capped.scene_cnn_epochs == 1 and capped.max_train_images, cls


def test_npair_smoke_slice_holds_one_folds_of_100_gallery():
    """`npair --rows=all --smoke` failed: Table 1's rows (protocol folds_100, galleries
    of 100 images) share the word-mode run, which could not score them on 20 test images."""
    from tf_twobranch.systems.npair.pipeline import NPairRecipe
    capped, _ = recipes.apply_smoke(NPairRecipe(smoke=True))
    assert capped.max_test_images >= 100
