"""The house in code (issue 40): one folder per system over a core that imports none, and the
run-level apps reaching a system only through the registry (`tf_twobranch.systems`)."""
import ast
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "tf_twobranch"
SYSTEMS = ("two_branch", "dual_path", "fragments", "npair")
REGISTRY = {"tf_twobranch.systems", "tf_twobranch.systems.registry"}
# The run-level apps: they load, export, compare or check runs of any system.
APPS = {"tf_twobranch.runs", "tf_twobranch.run_folders", "tf_twobranch.run_export",
        "tf_twobranch.leaderboard", "tf_twobranch.tools.export_run"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _system_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["tf_twobranch", "systems"] and len(parts) > 2 and parts[2] in SYSTEMS:
        return parts[2]
    return None


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_system_has_its_folder_and_registers_one_system_object():
    from tf_twobranch import systems
    assert tuple(s.name for s in systems.all()) == SYSTEMS
    for name in SYSTEMS:
        assert (PACKAGE / "systems" / name / "system.py").is_file()
        assert systems.get(name).name == name


def test_no_core_module_imports_a_system():
    for module, path in MODULES.items():
        if module.startswith("tf_twobranch.systems") or module in APPS:
            continue
        found = sorted(m for m in _imports(path) if m.startswith("tf_twobranch.systems"))
        assert not found, f"{module} (core) imports {found}"


def test_apps_reach_a_system_only_through_the_registry():
    for module in sorted(APPS):
        found = sorted(m for m in _imports(MODULES[module]) if _system_of(m))
        assert not found, f"{module} imports {found} (use tf_twobranch.systems.get / for_task / for_model)"


def test_no_system_folder_imports_another_or_an_app():
    for module, path in MODULES.items():
        own = _system_of(module)
        if own is None:
            continue
        imports = _imports(path)
        others = sorted(m for m in imports if _system_of(m) not in (None, own))
        assert not others, f"{module} imports another system: {others}"
        apps = sorted(m for m in imports if m in APPS or m.split(".")[0] == "experiments")
        assert not apps, f"{module} imports an app: {apps}"


def test_no_importlib_and_no_module_function_strings_in_the_package():
    for module, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        assert "importlib" not in _imports(path), module
        assert "import_module(" not in text, module


@pytest.mark.parametrize("name", SYSTEMS)
def test_system_objects_import_no_tensorflow(name):
    import subprocess
    import sys
    code = (f"import sys, tf_twobranch.systems.{name}.system, tf_twobranch.run_folders; "
            "sys.exit('tensorflow' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def _defined_methods(name: str) -> list[str]:
    """The modules of the package that define a method `name` on a class."""
    out = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                out += [f"{module}.{node.name}" for item in node.body
                        if isinstance(item, ast.FunctionDef) and item.name == name]
    return out


@pytest.mark.parametrize("method", ["train_step", "test_step", "evaluate"])
def test_training_step_and_evaluate_are_written_once(method):
    assert _defined_methods(method) == [f"tf_twobranch.models.base.SystemModel"]


def test_every_system_model_subclasses_the_base_and_saves_its_config_through_it(tmp_path):
    from tf_twobranch.models.base import SystemModel
    from tf_twobranch.systems.dual_path.model import DualPathModel
    from tf_twobranch.systems.fragments.model import FragmentEmbeddingModel
    from tf_twobranch.systems.npair.model import NPairLocalizationModel
    from tf_twobranch.systems.two_branch.model import TwoBranchModel
    for model_class in (TwoBranchModel, DualPathModel, FragmentEmbeddingModel, NPairLocalizationModel):
        assert issubclass(model_class, SystemModel)
        assert model_class.CONFIG_CLASS is not SystemModel.CONFIG_CLASS, model_class
        assert "loss" in model_class.LOGGED_TERMS
    wrappers = [m for m in MODULES if any(f"def {verb}_{kind}config(" in MODULES[m].read_text(encoding="utf-8")
                                          for verb in ("save", "load") for kind in ("", "fragment_", "npair_",
                                                                                    "dual_path_"))]
    assert wrappers == ["tf_twobranch.models.base"], wrappers


TESTS = REPO_ROOT / "tests"
# Where a test file may live: the layout of the package (core by package, one folder per system,
# the run-level apps), then the benchmarks' own parts and the project as a whole (docs, house).
TEST_FOLDERS = ({"core", "apps", "bench", "project", "systems"}
                | {f"core/{package}" for package in ("data", "features", "evaluation", "training", "export")}
                | {f"systems/{name}" for name in SYSTEMS})


def test_tests_follow_the_layout_and_every_system_has_its_test_folder():
    test_files = sorted(TESTS.rglob("test_*.py"))
    misplaced = [str(p.relative_to(TESTS)) for p in test_files if p.parent.relative_to(TESTS).as_posix() not in TEST_FOLDERS]
    assert not misplaced, f"test files outside {sorted(TEST_FOLDERS)}: {misplaced}"
    for name in SYSTEMS:
        assert list((TESTS / "systems" / name).glob("test_*.py")), f"tests/systems/{name}/ holds no tests"
    # pytest imports a test file by its name (no __init__.py in the test folders): names are unique.
    names = [p.name for p in test_files]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    assert not [p for p in TESTS.rglob("__init__.py") if p.parent.relative_to(TESTS).as_posix() in TEST_FOLDERS]


def test_every_test_path_the_docs_and_the_code_name_exists():
    import re
    sources = [REPO_ROOT / "README.md", REPO_ROOT / "BUILD_NOTES.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
               *sorted(PACKAGE.rglob("*.py")), *sorted(TESTS.rglob("*.py"))]
    missing = []
    for source in sources:
        for found in re.findall(r"\btests/[\w/.*<>]+", source.read_text(encoding="utf-8")):
            path = found.rstrip(".")
            path = re.sub(r"<\w+>", "*", path)   # a pattern (tests/systems/<name>/) names a glob
            if "*" in path:
                ok = any(REPO_ROOT.glob(path))
            else:
                ok = (REPO_ROOT / path).exists() or (REPO_ROOT / (path.split("::")[0])).exists()
            if not ok:
                missing.append(f"{source.relative_to(REPO_ROOT)}: {found}")
    assert not missing, missing


def test_apps_hold_no_system_data_no_task_names_or_row_flagfiles():
    """What a system's runs are called and which rows the leaderboard trains (its lines, the paper
    orderings and their sibling rows) are declared by the system, not written into an app."""
    from tf_twobranch import systems
    tasks = set(systems.tasks())
    stems = {p.stem for p in (REPO_ROOT / "experiments" / "configs").glob("*.cfg")}
    for module in sorted(APPS):
        strings = {node.value for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8")))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not strings & (tasks | stems), f"{module} names {sorted(strings & (tasks | stems))}"


# Modules under experiments/ that serve every system.
SHARED_EXPERIMENTS = {"__init__", "common", "leaderboard"}


def test_each_system_goes_by_one_name():
    """A system's name is its folder, its registry entry, its models' family and the start of its
    tasks, of its experiments and of its flagfiles (issue 40); the papers' older names live on only
    as aliases of the tasks old run folders recorded."""
    from tf_twobranch import systems
    names = [s.name for s in systems.all()]

    def owner(name: str) -> str | None:
        return next((s for s in sorted(names, key=len, reverse=True) if name == s or name.startswith(s + "_")), None)

    for system in systems.all():
        assert system.model_family == system.name
        for task in system.tasks:
            assert owner(task.name) == system.name, task
            assert task.experiment.removeprefix("experiments.").startswith(system.name), task
    experiments = {p.stem for p in (REPO_ROOT / "experiments").glob("*.py")} - SHARED_EXPERIMENTS
    assert not {e for e in experiments if owner(e) is None}, "experiments named after no system"
    stems = {p.stem for p in (REPO_ROOT / "experiments" / "configs").glob("*.cfg")}
    assert not {s for s in stems if owner(s) is None}, "flagfiles named after no system"
    assert {owner(s) for s in stems} == set(SYSTEMS)


def test_run_folders_written_under_the_papers_names_are_still_read(tmp_path):
    """Folders recorded before each system had one name (results.json["task"] the papers' names)."""
    import json
    from tf_twobranch import systems
    from tf_twobranch.run_folders import read_run_task
    for old, new in (("image_sentence_retrieval", "two_branch_retrieval"),
                     ("phrase_localization", "two_branch_region_phrase"),
                     ("fragment_embeddings", "fragments"), ("npair_localization", "npair")):
        (tmp_path / old).mkdir()
        (tmp_path / old / "results.json").write_text(json.dumps({"task": old}))
        task, source = read_run_task(tmp_path / old)
        assert task.name == new and source.endswith("results.json")
        assert systems.for_task(old) is systems.for_task(new)
