"""The newcomer check's reading of the docs (benchmarks/newcomer.py), and that every command the
README and docs/SERVING.md give parses: the heavy part, running them all as written, is
`python -m benchmarks.newcomer` (not a unit test; its table is in BUILD_NOTES.md)."""
from __future__ import annotations

import importlib.util
import shlex
import subprocess

import pytest

from benchmarks import newcomer


def test_blocks_commands_and_skip_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# T\n\n## A\n\n<!-- newcomer: skip: needs Flickr30K on disk -->\n```bash\npython -m x \\\n    --a=1\n```\n\n"
        "<!-- docs-test: skip: other test -->\n<!-- newcomer: skip: a server -->\n```sh\ncurl x\n```\n"
        "```bash\n# a comment\nD=runs/a/export\npython -c \"import json\nprint(1)\"\nls $D  # list it\n```\n"
        "## B\n```python\nx = 1\n```\n```text\nnot run\n```\n<!-- newcomer: skip -->\n```bash\nfalse\n```\n")
    commands = newcomer.document_commands(page)
    assert [(c.section, c.kind, c.text, c.skip) for c in commands] == [
        ("A", "bash", "python -m x --a=1", "needs Flickr30K on disk"),
        ("A", "bash", "curl x", "a server"),
        ("A", "bash", "D=runs/a/export", None),
        ("A", "bash", "python -c \"import json\nprint(1)\"", None),
        ("A", "bash", "ls $D  # list it", None),
        ("B", "python", "x = 1\n", None),
        ("B", "bash", "false", ""),
    ]
    assert commands[4].prelude == "D=runs/a/export\n" and commands[2].prelude == ""


def test_the_tree_memory_of_a_command_counts_its_children(tmp_path):
    command = newcomer.Command("x", "s", 1, "bash",
                               "python -c 'import time; b = bytearray(300_000_000); b[::4096] = b\"x\" * len(b[::4096]); "
                               "time.sleep(1.5)'", None)
    with open(tmp_path / "log", "w") as log:
        result = newcomer.run_command(command, tmp_path, {"PATH": "/usr/bin:/bin:" + _python_dir()}, log, 60)
    assert result["rc"] == 0 and result["peak_gb"] > 0.3


def _python_dir():
    import os
    import sys
    return os.path.dirname(sys.executable)


COMMANDS = newcomer.all_commands()


def test_every_skip_marker_has_a_reason():
    assert not [f"{c.document}:{c.line}" for c in COMMANDS if c.skip == ""]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.skip is None],
                         ids=lambda c: f"{c.document}:{c.line}")
def test_every_documented_command_parses(command):
    where = f"{command.document}:{command.line}: {command.text[:200]}"
    if command.kind == "python":
        compile(command.text, where, "exec")
        return
    syntax = subprocess.run(["bash", "-n", "-c", command.prelude + command.text], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{where}\n{syntax.stderr}"
    lexer = shlex.shlex(command.text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as err:
        pytest.fail(f"{where}: {err}")
    parts, current = [], []
    for token in tokens:
        if token in ("&&", ";", "|", "||"):
            parts.append(current)
            current = []
        else:
            current.append(token)
    for argv in parts + [current]:
        if argv[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(argv[2]) is not None, f"{where}: no module {argv[2]}"
        if argv[:2] == ["python", "-c"]:
            compile(argv[2], where, "exec")
        for arg in argv:
            if arg.startswith("--flagfile="):
                assert (newcomer.REPO / arg.split("=", 1)[1]).is_file(), f"{where}: no {arg}"


def test_resume_skips_what_passed_at_the_same_commit(tmp_path, monkeypatch):
    # The README as written takes ~5 hours here: a run must be able to go on where it stopped.
    import os
    import sys

    clone = tmp_path / "work" / "tf_twobranch"
    clone.mkdir(parents=True)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=clone, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], cwd=clone, check=True)
    (tmp_path / "work" / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "work" / "venv" / "bin" / "python")
    marks = tmp_path / "marks"
    commands = [newcomer.Command("README.md", "S", i, "bash", f"echo {i} >> {marks}", None) for i in (1, 2)]
    commands.append(newcomer.Command("README.md", "S", 3, "bash", f"test -e {tmp_path}/go", None))
    monkeypatch.setattr(newcomer, "all_commands", lambda root=None: commands)
    argv = [f"--workdir={tmp_path / 'work'}", f"--out_json={tmp_path / 'out.json'}"]
    assert newcomer.main(argv) == 1                          # the third command fails
    (tmp_path / "go").touch()
    assert newcomer.main([*argv, "--resume"]) == 0           # only the third runs again
    assert marks.read_text().split() == ["1", "2"]
    assert newcomer.main(argv) == 0                          # without --resume: everything again
    assert marks.read_text().split() == ["1", "2", "1", "2"]


def test_every_gallery_a_command_reads_is_made_above_it():
    """The newcomer run at 54f6c6f stopped at SERVING.md's ``--gallery_images=photos/
    --gallery_captions=captions.txt``: no command above it made them."""
    import re
    for index, command in enumerate(COMMANDS):
        for path in re.findall(r"--gallery_(?:images|captions)=(\S+)", command.text):
            name = path.rstrip("/")
            above = [c.text for c in COMMANDS[:index] if c.document == command.document]
            assert any(re.search(rf"['\"> ]{re.escape(name)}\b", text) for text in above), \
                f"{command.document}:{command.line} reads {path}, which no command above it makes"
