"""`python -m <module> <args>` and `python -c <code>` for the tests, without a TensorFlow start each.

Each command runs as ``__main__`` with its own argv, working folder, environment, stdout and
stderr, exit code and process, as with ``subprocess.run([python, "-m", module, *args])``. What
differs: one server process per test process imports TensorFlow, tensorflow-text and Keras once
(~6 s here) and forks a child per command, so a command costs a fork instead of an interpreter
start and those imports. Nothing has created a TensorFlow runtime when a child forks: each child
starts its own, as a new process would.

What a fork cannot give, and the tests that need it keep `subprocess`: settings TensorFlow reads
when it is imported (``TF_ENABLE_ONEDNN_OPTS``, ``TF_CPP_MIN_LOG_LEVEL``: the server's are the
test process's), a process to signal from outside (the preemption tests), and modules already
imported by the server come from the test checkout whatever ``PYTHONPATH`` says (the same code
here: the package is installed from that checkout).
"""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import subprocess
import sys
import threading
from typing import NamedTuple, Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_SERVER = r"""
import json, os, runpy, sys, tempfile, time, traceback
reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)                 # a stray print while importing must not reach the reply channel
import tf_twobranch           # noqa: F401  sets TF_ENABLE_ONEDNN_OPTS before TensorFlow loads, as in a run
import tensorflow             # noqa: F401
import tensorflow_text        # noqa: F401
import keras                  # noqa: F401
import absl.app, absl.flags, absl.logging, h5py, numpy, PIL.Image, scipy.sparse, sklearn.decomposition  # noqa
path0 = sys.path[0]


def child(request):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(request["out"], 1)
    os.dup2(request["err"], 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    code = 0
    try:
        if request["kind"] == "-m":
            sys.argv = [request["target"], *request["args"]]
            sys.path[0] = os.getcwd()
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *request["args"]]
            sys.path[0] = ""
            exec(compile(request["target"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exit_:
        if isinstance(exit_.code, int):
            code = exit_.code
        elif exit_.code is not None:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


for line in sys.stdin:
    request = json.loads(line)
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    request["out"], request["err"] = (f.fileno() for f in files)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(request)
        finally:
            os._exit(code)
    deadline, timed_out = time.monotonic() + request["timeout"], False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            _, status = os.waitpid(pid, 0)
            timed_out = True
            break
        time.sleep(0.005)
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
        f.close()
    reply.write(json.dumps([os.waitstatus_to_exitcode(status), *texts, timed_out]) + "\n")
"""


class Completed(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class _Server:
    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None

    def start(self):
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=REPO_ROOT, env=env, bufsize=1)
        atexit.register(self.stop)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def run(self, request: dict) -> list:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.start()
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the forking server exited with code {self.proc.wait()}")
            return json.loads(line)


_server = _Server()


def run_python(argv: Sequence[str], *, cwd=None, env=None, timeout: float = 600, capture_output: bool = True,
               text: bool = True) -> Completed:
    """``python -m module args...`` or ``python -c code args...``.

    `argv` may start with the interpreter (``sys.executable``), so that a
    ``subprocess.run([sys.executable, "-m", ...], capture_output=True, text=True, cwd=..., env=...,
    timeout=...)`` call reads the same with `run_python` in its place. Returns what that call
    would; raises `subprocess.TimeoutExpired` after `timeout` seconds (the child is killed).
    """
    if not (capture_output and text):
        raise ValueError("run_python always captures stdout and stderr as text")
    argv = [str(a) for a in argv]
    if argv and argv[0] == sys.executable:
        argv = argv[1:]
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        raise ValueError(f"expected ['-m', module, ...] or ['-c', code, ...], got {argv[:2]}")
    request = {"kind": argv[0], "target": argv[1], "args": argv[2:],
               "cwd": str(cwd if cwd is not None else os.getcwd()),
               "env": dict(os.environ if env is None else env), "timeout": float(timeout)}
    code, out, err, timed_out = _server.run(request)
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out, err)
    return Completed(code, out, err)


def run_modules(commands: Sequence[Sequence[str]], *, cwd=None, env=None, timeout: float = 600) -> list[Completed]:
    """Runs each ``[module, *args]`` (as ``python -m module args``); returns their results in order."""
    return [run_python(["-m", *command], cwd=cwd, env=env, timeout=timeout) for command in commands]
