"""`python -m <module> <args>` and `python -c <code>` for the tests, without a TensorFlow start each.

Each command runs as ``__main__`` with its own argv, working folder, environment, standard
streams, exit code and process, as with ``subprocess.run([python, "-m", module, *args])``. What
differs: one server process per test process imports TensorFlow, tensorflow-text and Keras once
(~6 s here) and forks a child per command, so a command costs a fork instead of an interpreter
start and those imports. Nothing has created a TensorFlow runtime when a child forks: each child
starts its own, as a new process would.

Two ways in: `run_python` from a test, and `python_shim`, an executable named ``python`` for the
``PATH`` of shell commands run as written (the serving docs): it hands its argv, folder,
environment and its own stdin/stdout/stderr to the server over a Unix socket and exits with the
command's code (anything but ``-m``/``-c`` runs the real interpreter).

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
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import NamedTuple, Sequence

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SOCKET_ENV = "TF_TWOBRANCH_TEST_FORK_SERVER"

_SERVER = r"""
import json, os, runpy, select, socket, sys, time, traceback
reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)                 # a stray print while importing must not reach the reply channel
import tf_twobranch           # noqa: F401  sets TF_ENABLE_ONEDNN_OPTS before TensorFlow loads, as in a run
import tensorflow             # noqa: F401
import tensorflow_text        # noqa: F401
import keras                  # noqa: F401
import absl.app, absl.flags, absl.logging, h5py, numpy, PIL.Image, scipy.sparse, sklearn.decomposition  # noqa


def child(request, fds):
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
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


def serve(conn):
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            conn.close()
            code = child(request, fds)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
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
    conn.send(json.dumps([os.waitstatus_to_exitcode(status), timed_out]).encode())


listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(8)
reply.write("ready\n")
while True:
    ready, _, _ = select.select([listener, sys.stdin], [], [])
    if sys.stdin in ready and not sys.stdin.readline():
        break                 # the test process closed our stdin (or died): stop
    if listener in ready:
        conn, _ = listener.accept()
        with conn:
            serve(conn)
"""

# `python` for shell commands: hands -m / -c commands to the server, runs anything else itself.
_SHIM = r"""import json, os, socket, sys
argv = sys.argv[1:]
if len(argv) < 2 or argv[0] not in ("-m", "-c") or not os.environ.get({socket_env!r}):
    os.execv({python!r}, [{python!r}, *argv])
request = {{"kind": argv[0], "target": argv[1], "args": argv[2:], "cwd": os.getcwd(), "env": dict(os.environ),
           "timeout": 3600.0}}
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect(os.environ[{socket_env!r}])
socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
code, _ = json.loads(conn.recv(4096))
sys.exit(code if code >= 0 else 128 - code)
"""


class Completed(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class _Server:
    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None
        atexit.register(self.stop)

    def address(self) -> str:
        """The socket path of this process's server (started on first use)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            return self.path

    def _start(self):
        self.folder = tempfile.mkdtemp(prefix="tf2b_fork_")
        self.path = os.path.join(self.folder, "socket")
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT,
                                     env=env)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the forking server did not start (exit code {self.proc.wait()})")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(getattr(self, "folder", ""), ignore_errors=True)


_server = _Server()


def run_python(argv: Sequence[str], *, cwd=None, env=None, timeout: float = 600) -> Completed:
    """``python -m module args...`` or ``python -c code args...`` (`argv`: ``["-m", module, ...]``).

    Returns what ``subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=...,
    env=..., timeout=...)`` would; raises `subprocess.TimeoutExpired` after `timeout` seconds (the
    child is killed).
    """
    argv = [str(a) for a in argv]
    if len(argv) < 2 or argv[0] not in ("-m", "-c"):
        raise ValueError(f"expected ['-m', module, ...] or ['-c', code, ...], got {argv[:2]}")
    request = {"kind": argv[0], "target": argv[1], "args": argv[2:],
               "cwd": str(cwd if cwd is not None else os.getcwd()),
               "env": dict(os.environ if env is None else env), "timeout": float(timeout)}
    address = _server.address()
    with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(address)
            socket.send_fds(conn, [json.dumps(request).encode()], [stdin.fileno(), out.fileno(), err.fileno()])
            code, timed_out = json.loads(conn.recv(4096))
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, *texts)
    return Completed(code, *texts)


def run_modules(commands: Sequence[Sequence[str]], *, cwd=None, env=None, timeout: float = 600) -> list[Completed]:
    """Runs each ``[module, *args]`` (as ``python -m module args``); returns their results in order."""
    return [run_python(["-m", *command], cwd=cwd, env=env, timeout=timeout) for command in commands]


def python_shim(bin_dir) -> dict:
    """Writes ``<bin_dir>/python`` (see the module docstring); returns the environment entries that
    put it first on ``PATH`` and name this process's server."""
    bin_dir = pathlib.Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "python"
    shim.write_text(f"#!{sys.executable} -S\n" + _SHIM.format(python=sys.executable, socket_env=SOCKET_ENV))
    shim.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SOCKET_ENV: _server.address()}
