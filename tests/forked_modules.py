"""Command-line modules run as `python -m <module> <args>` runs them, for many commands at once.

Each command runs as ``__main__`` with its own argv, stdout and stderr, exit code and process, as
with `subprocess.run([python, "-m", module, *args])`. What differs: one interpreter imports
TensorFlow (and tensorflow-text) once and forks a child per command, so N commands cost one
interpreter start and TensorFlow import (~6 s here) instead of N. Nothing has created a TensorFlow
runtime when the children fork: each child starts its own, as a new process would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import NamedTuple, Sequence

_DRIVER = r"""
import json, os, runpy, sys, tempfile
import tensorflow  # noqa: F401
import tensorflow_text  # noqa: F401
commands = json.loads(sys.stdin.read())
results = []
for module, args in commands:
    out_file, err_file = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        sys.argv = [module, *args]
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            if isinstance(exit_.code, int):
                code = exit_.code
            elif exit_.code is not None:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    texts = []
    for f in (out_file, err_file):
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
        f.close()
    results.append([os.waitstatus_to_exitcode(status), *texts])
sys.__stdout__.write("\n" + json.dumps(results) + "\n")
"""


class Completed(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def run_modules(commands: Sequence[Sequence[str]], *, cwd=None, env=None, timeout: float = 600) -> list[Completed]:
    """Runs each ``[module, *args]`` (as ``python -m module args``); returns their results in order."""
    env = dict(os.environ if env is None else env)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    payload = json.dumps([[c[0], list(c[1:])] for c in commands])
    proc = subprocess.run([sys.executable, "-c", _DRIVER], input=payload, capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the forking driver failed:\n{proc.stderr[-4000:]}")
    return [Completed(*r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]
