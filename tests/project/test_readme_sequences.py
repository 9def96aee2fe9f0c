"""The README's command sequences (issue 24, item 6).

Every run folder a README command names (``two_branch_draw --saved_model/--run_dir``,
``fragments_draw`` and ``npair_draw --run_dir``,
``saved_model_cli --dir``, the notebook's and the dual path's ``load_run``) must be made by a
command above it, under the one run-folder rule (`tf_twobranch.table_runner.run_folder`).

* `test_readme_follow_up_commands_name_folders_made_above_them` (fast, no training) reads the
  README in order and checks each named folder against the folders the commands above it
  make, computed with the runner's own rule and row selection.
* `test_readme_sequences_run_at_tiny_size` (heavy: opt-in with
  ``TF_TWOBRANCH_README_SEQUENCES=1``; ~5 min on 2 cores) runs each
  sequence as written, with ``--smoke`` and tiny sizes appended, on a small generated dataset
  (``$TF_TWOBRANCH_DATA``) with the run folders under a temporary ``runs/``
  (``$TF_TWOBRANCH_RUNS``, the README's relative ``runs/...`` from a temporary working folder),
  and checks that each folder a later command names exists and the command succeeds.
* `test_serving_docs_run_as_written` (fast; issue 25 item 4) executes every code block of
  docs/SERVING.md and of the README's "Serving" section (`doc_blocks`): ``bash``/``sh`` blocks with
  ``bash -e`` (``python`` = this interpreter), ``python`` blocks with ``exec`` (one namespace per
  document, in order, like a notebook), ``json`` blocks parsed, in a working folder whose
  ``runs/.../export`` folders are tiny exports of each family (`tests.support.serving_exports.make_doc_folder`).
  A block that cannot run here (a model server, a trained run, a spaCy model) carries the line
  ``<!-- docs-test: skip: <reason> -->`` right above it; a marker without a reason fails the test.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tf_twobranch import table_runner

REPO = table_runner.REPO_ROOT
README = REPO / "README.md"
OWNED = ("two_branch_table", "two_branch_retrieval", "two_branch_region_phrase", "dual_path",
         "two_branch_combined_distance", "two_branch_draw", "fragments", "fragments_draw",
         "npair", "npair_draw")
RUN_PATH = re.compile(r"runs/[A-Za-z0-9_./-]+")


def readme_commands() -> list[tuple[str, str]]:
    """(section, command) of every shell command in the README's bash blocks and every
    ``load_run("...")`` of its python blocks, in order (continuation lines joined, comments cut)."""
    out, section, block, pending = [], "", None, ""
    for line in README.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#+ (.*)", line) if block is None else None
        if heading:
            section = heading.group(1).strip()
        if line.startswith("```"):
            block = None if block else (line[3:].strip() or "text")
            continue
        if block == "bash":
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            text = re.sub(r"\s+", " ", re.sub(r"\s+#.*$", "", text)).strip()
            if text:
                out.append((section, text))
        elif block == "python":
            found = re.search(r"load_run\(\"(runs/[^\"]+)\"\)", line)
            if found:
                out.append((section, f"load_run {found.group(1)}"))
            elif section == "Serving":     # the serving snippet's exports, as "saved_model_cli" reads them
                for folder in re.findall(r"\"(runs/[^\"]+)\"", line):
                    out.append((section, f"saved_model_cli (python) {folder}"))
    return out


SKIP_MARKER = re.compile(r"<!--\s*docs-test:\s*skip\b:?\s*(.*?)\s*-->")


def doc_blocks(path: pathlib.Path, section: str | None = None) -> list[dict]:
    """The fenced code blocks of a Markdown file (of one ``## section`` when given), in order:
    ``{"section", "lang", "code", "line", "skip"}``, where ``skip`` is the reason of a
    ``<!-- docs-test: skip: ... -->`` marker on the line above the fence ("" when the marker has
    none, None without a marker)."""
    out, current, block, previous = [], "", None, ""
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if block is None:
            heading = re.match(r"(#+) (.*)", line)
            if heading and len(heading.group(1)) <= 2:
                current = heading.group(2).strip()
            if line.startswith("```"):
                marker = SKIP_MARKER.search(previous)
                block = {"section": current, "lang": line[3:].strip() or "text", "code": [], "line": number,
                         "skip": marker.group(1) if marker else None}
            elif line.strip():
                previous = line
            continue
        if line.startswith("```"):
            block["code"] = "\n".join(block["code"]) + "\n"
            if section is None or block["section"] == section:
                out.append(block)
            block, previous = None, ""
        else:
            block["code"].append(line)
    return out


def _module(command: str) -> str | None:
    found = re.search(r"-m experiments\.(\w+)", command)
    return found.group(1) if found else None


def _flag(command: str, name: str) -> str | None:
    found = re.search(rf"--{name}=(\S+)", command)
    return found.group(1) if found else None


def folders_made(command: str) -> set[str]:
    """The run folders (relative, 'runs/...') a README command of an owned family makes."""
    module = _module(command)
    if module not in OWNED or _flag(command, "dataset_dir"):
        return set()
    runs = pathlib.Path("runs")

    def row(cfg, export: bool, extra=()) -> set[str]:
        folder = table_runner.run_folder(runs, cfg)
        return {str(folder), *(str(folder / e) for e in ((("export",) if export else ()) + tuple(extra)))}

    made: set[str] = set()
    if module == "two_branch_table":
        from experiments.two_branch_table import MAIN_ROWS
        rows = (_flag(command, "rows") or "").split(",") if _flag(command, "rows") else []
        table = _flag(command, "table") or "2"
        configs = table_runner.select_rows(rows, pattern=f"two_branch_table{table}_*.cfg", default=lambda every: [
            c for c in every if any(k in c.stem for k in MAIN_ROWS)])
        for cfg in configs:
            made |= row(cfg, "b6" in cfg.stem)
    elif module == "two_branch_region_phrase" and _flag(command, "rows"):
        for cfg in table_runner.select_rows(_flag(command, "rows").split(","), pattern="two_branch_table1_*.cfg"):
            made |= row(cfg, "b5" in cfg.stem)
    elif module in ("two_branch_retrieval", "two_branch_region_phrase", "dual_path") and _flag(command, "flagfile"):
        made |= row(_flag(command, "flagfile"), "--noexport" not in command,
                    ("stage1", "stage2") if module == "dual_path" else ())
    elif module == "fragments" and _flag(command, "rows"):
        from experiments.fragments_tables import select_rows
        for cfg in select_rows(_flag(command, "rows").split(","), _flag(command, "table") or "all"):
            made |= row(cfg, False)     # a Table 3 twin shares its Table 2 row's model and stages
    elif module == "fragments" and _flag(command, "flagfile"):
        made |= row(_flag(command, "flagfile"), "--noexport" not in command, ("stage1", "stage2"))
    elif module == "npair" and _flag(command, "rows"):
        from experiments.npair_tables import select_rows
        for cfg in select_rows(_flag(command, "rows").split(",")):
            made |= row(cfg, False)     # a row sharing another's model has no checkpoints of its own
    elif module == "npair" and _flag(command, "flagfile"):
        made |= row(_flag(command, "flagfile"), "--noexport" not in command)
    elif module == "two_branch_combined_distance":
        made |= {str(table_runner.run_folder(runs, _flag(command, "flagfile")))}
    return made


def folders_named(command: str) -> list[str]:
    """The run folders a command reads (not the ones it makes)."""
    if command.startswith("load_run "):
        return [command.split(" ", 1)[1]]
    module = _module(command)
    if "saved_model_cli" in command or module in ("two_branch_draw", "fragments_draw", "npair_draw") or \
            ("load_run(" in command and module is None):
        return [p.rstrip("'\")") for p in RUN_PATH.findall(command)]
    return []


def test_readme_has_the_sequences():
    commands = [c for _, c in readme_commands()]
    assert any("experiments.two_branch_table" in c for c in commands)
    assert any("experiments.two_branch_draw" in c for c in commands)
    assert any(c.startswith("load_run runs/") for c in commands)
    assert any("saved_model_cli show --dir runs/" in c for c in commands)


def test_readme_follow_up_commands_name_folders_made_above_them():
    made: set[str] = set()
    for section, command in readme_commands():
        for folder in folders_named(command):
            assert folder.rstrip("/") in made, f"README, {section}: {command!r} names {folder}, which no " \
                                               f"command above it makes (made: {sorted(made)})"
        made |= folders_made(command)


# --------------------------------------------------------------------------- slow: run them

TINY = {
    "two_branch_table": ["--hidden_dim=32", "--embed_dim=16", "--batch_size=20", "--top_k=3",
                        "--scene_cnn_epochs=1", "--word_dim=8", "--verbose=0", "--cca_components=8"],
    "two_branch_region_phrase": ["--hidden_dim=32", "--embed_dim=16", "--batch_size=20", "--top_k=3",
                            "--scene_cnn_epochs=1", "--word_dim=8", "--verbose=0",
                            "--negatives_per_phrase=5"],
    "dual_path": ["--text_width=2", "--text_blocks=1,1,1,1", "--hidden_dim=16", "--embed_dim=16",
                      "--word_dim=8", "--verbose=0", "--batch_size=16", "--max_test_images=12"],
    "two_branch_draw": ["--num_images=1", "--max_captions=1"],
}
# The sequences run here: a command runs when it is the first of these in its section.
SEQUENCES = {
    "tf_twobranch": ("two_branch_table",),
    "Phrase localization (Table 1, Table 5, Fig. 2)": ("two_branch_region_phrase --flagfile", "two_branch_draw"),
    "Dual-path CNN with instance loss": ("dual_path_table2_full_model", "load_run('runs/dual_path"),
    "In a notebook": ("load_run runs/",),
    "Serving": ("saved_model_cli show",),
}


def _tiny_command(command: str) -> list[str]:
    if command.startswith("load_run "):
        folder = command.split(" ", 1)[1]
        return [sys.executable, "-c", "from tf_twobranch.runs import load_run; "
                f"r = load_run({folder!r}); print(r.model.evaluate(r.evaluation_split()))"]
    argv = shlex.split(command.split("&&")[-1])
    if argv[0] == "python":
        argv[0] = sys.executable
    if argv[0] == "saved_model_cli":
        return [sys.executable, "-c", "import sys, tensorflow as tf; tf.saved_model.load(sys.argv[1])",
                argv[argv.index("--dir") + 1]]
    module = _module(command)
    if module in TINY:
        argv += TINY[module] + ([] if module == "two_branch_draw" else ["--smoke"])
    return argv


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TF_TWOBRANCH_README_SEQUENCES"),
                    reason="heavy (trains the main job, a Table 1 row and a dual-path row at tiny size, "
                           "~5 min on 2 cores): set TF_TWOBRANCH_README_SEQUENCES=1 to run it")
def test_readme_sequences_run_at_tiny_size(tmp_path):
    from tf_twobranch.data.embedded import generate_embedded_dataset
    data = generate_embedded_dataset(tmp_path / "scenes", num_images=120, splits=(60, 20, 40),
                                     num_proposals=20)
    (tmp_path / "experiments").symlink_to(REPO / "experiments")   # the README's relative paths
    env = {**os.environ, "TF_TWOBRANCH_DATA": str(data), "TF_TWOBRANCH_RUNS": str(tmp_path / "runs"),
           "PYTHONPATH": str(REPO)}
    ran = []
    for section, command in readme_commands():
        wanted = SEQUENCES.get(section, ())
        if _flag(command, "dataset_dir") or not any(w in command for w in wanted):
            continue
        for folder in folders_named(command):
            assert (tmp_path / folder).exists(), f"{section}: {command!r} names {folder}, not made above it"
        proc = subprocess.run(_tiny_command(command), cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        if _module(command) in ("two_branch_table", "two_branch_region_phrase", "dual_path"):
            assert "Next:" in proc.stdout, proc.stdout[-2000:]
        ran.append(command)
    assert len(ran) >= 6, ran


# --------------------------------------------------------------------------- fast: the serving docs run as written

SERVING_DOCS = REPO / "docs" / "SERVING.md"


def _serving_doc_blocks() -> list[dict]:
    return doc_blocks(SERVING_DOCS) + doc_blocks(README, "Serving")


def test_doc_blocks_and_skip_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n## A\n\n<!-- docs-test: skip: needs a server -->\n```sh\ncurl x\n```\n\n"
                    "```python\nx = 1\n```\n<!-- docs-test: skip -->\n\n```bash\nfalse\n```\n## B\n```json\n{}\n```\n")
    blocks = doc_blocks(page)
    assert [(b["section"], b["lang"], b["skip"]) for b in blocks] == [
        ("A", "sh", "needs a server"), ("A", "python", None), ("A", "bash", ""), ("B", "json", None)]
    assert blocks[1]["code"] == "x = 1\n" and [b["lang"] for b in doc_blocks(page, "B")] == ["json"]


@pytest.fixture(scope="module")
def doc_folder(tmp_path_factory):
    from tests.support.serving_exports import make_doc_folder
    return make_doc_folder(tmp_path_factory.mktemp("serving_docs"), tmp_path_factory)


def test_serving_docs_run_as_written(doc_folder, monkeypatch):
    blocks = _serving_doc_blocks()
    assert any(b["section"] == "Serving" for b in blocks), "README has no Serving section with code"
    from tests.support.forked_modules import python_shim
    # `python` in the docs' commands: this interpreter (its -m / -c commands forked from one process
    # that has imported TensorFlow, instead of a TensorFlow start each).
    env = {**os.environ, **python_shim(doc_folder / "_bin"), "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    monkeypatch.chdir(doc_folder)
    namespaces: dict[str, dict] = {}
    ran, skipped = [], []
    for block in blocks:
        where = f"{'README.md' if block['section'] == 'Serving' else 'docs/SERVING.md'}, line {block['line']}"
        if block["skip"] is not None:
            assert block["skip"], f"{where}: a docs-test skip marker needs a reason"
            skipped.append((where, block["skip"]))
            continue
        if block["lang"] in ("bash", "sh"):
            proc = subprocess.run(["bash", "-e", "-c", block["code"]], cwd=doc_folder, env=env,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"{where}:\n{block['code']}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        elif block["lang"] == "python":
            namespace = namespaces.setdefault(where.split(",")[0], {"__name__": "__docs__"})
            try:
                exec(compile(block["code"], where, "exec"), namespace)
            except Exception as err:
                raise AssertionError(f"{where}:\n{block['code']}") from err
        elif block["lang"] == "json":
            json.loads(block["code"])
        else:
            continue          # text, tables of output
        ran.append(where)
    print(f"ran {len(ran)} blocks; skipped (marked): {skipped}")
    assert len(ran) >= 6, ran     # the blocks of both documents that need no server, run or model download
