"""One table runner for every experiment family: rows, overrides, resume, run-folder names.

A table is a list of row flagfiles (``experiments/configs/<stem>.cfg``). The
runner runs each row in a fresh parse of its flagfile plus the flags typed
after the runner's own (passed to every row), in its run folder, and reuses a
row that already finished with the same arguments (its ``results.json`` and
``table_row.json`` exist), so an interrupted table resumes where it stopped
(a row interrupted mid-training resumes from its own backup).

**One run-folder rule** (`run_folder`): a row run from a flagfile lives in
``<runs_dir>/<flagfile stem>``, whether it is run alone
(``python -m experiments.two_branch_retrieval --flagfile=.../two_branch_table2_b6_x.cfg``
-> ``runs/two_branch_table2_b6_x``) or by a table runner (``--rows``). A run without a
flagfile is named after its ``--row_name`` (slugged). ``--run_dir`` always wins.

API (no absl flags here; the experiments parse their flags and call it)::

    from tf_twobranch import table_runner
    configs = table_runner.select_rows(rows, pattern="two_branch_table1_*.cfg")    # --rows=<list>|all
    overrides = table_runner.row_arguments(argv, runner_flags)          # flags for every row
    records = table_runner.run_table(
        configs, run_row, overrides=overrides, runs_dir=runs_dir,       # run_row(cfg, args) -> record
        extra_arguments=lambda cfg: [...], resume=True, announce=print_row,
        share_key=None, share=None)                                     # rows sharing one run

`run_row(cfg, arguments)` parses ``cfg`` with ``arguments`` (which end with
``--run_dir=<run_folder(runs_dir, cfg)>``) and runs the row, returning its
record (written by the row to ``<run_dir>/results.json``).

**Rows sharing one run** (the fragment tables' Table 2/3 twins, the N-pair rows that differ
only in what is evaluated): with `share_key(cfg, arguments) -> key` (None: the row shares
nothing), the first row of a key is run (or reused) as usual, and each later row of the same
key gets `share(cfg, arguments, first_record) -> record` instead of `run_row`: the row's record
from its twin's (relabelled, evaluated again where it must be), which `share` writes to the
row's ``results.json`` like `run_row` does, so that the row resumes like any other.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Callable, Hashable, Iterable, Sequence

from tf_twobranch import json_files
from tf_twobranch.errors import UserInputError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "experiments" / "configs"
DEFAULT_RUNS_DIR = REPO_ROOT / "runs"
RUNS_DIR_VARIABLE = "TF_TWOBRANCH_RUNS"


def default_runs_dir() -> pathlib.Path:
    """Where run folders go by default: ``$TF_TWOBRANCH_RUNS``, else ``runs/`` in the repository."""
    override = os.environ.get(RUNS_DIR_VARIABLE)
    return pathlib.Path(override).expanduser() if override else DEFAULT_RUNS_DIR
ROW_RECORD = "table_row.json"


def slug(text: str) -> str:
    """A file-system friendly name for a table row."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "run"


def resolve_config(name: str | pathlib.Path) -> pathlib.Path:
    """A flagfile by path, or by bare name (with or without .cfg) inside experiments/configs/."""
    p = pathlib.Path(name)
    if p.exists():
        return p
    candidate = CONFIG_DIR / (p.name if p.name.endswith(".cfg") else f"{p.name}.cfg")
    if candidate.exists():
        return candidate
    raise UserInputError(f"flagfile {str(name)!r} not found (looked in {CONFIG_DIR})")


def run_folder(runs_dir: str | pathlib.Path | None, flagfile: str | pathlib.Path | None = None,
               row_name: str = "") -> pathlib.Path:
    """THE run-folder rule: ``<runs_dir>/<flagfile stem>``, or ``<runs_dir>/<slug(row_name)>``
    without a flagfile (runs_dir: default `default_runs_dir()`, ``runs/`` in the repository)."""
    parent = pathlib.Path(runs_dir) if runs_dir else default_runs_dir()
    if flagfile:
        return parent / pathlib.Path(str(flagfile)).stem
    return parent / slug(row_name or "run")


def flagfile_of(argv: Sequence[str]) -> str | None:
    """The last ``--flagfile`` given on a command line (the row it runs), or None."""
    found = None
    for i, arg in enumerate(argv):
        for prefix in ("--flagfile=", "-flagfile="):
            if arg.startswith(prefix):
                found = arg[len(prefix):] or found
        if arg in ("--flagfile", "-flagfile") and i + 1 < len(argv):
            found = argv[i + 1]
    return found


def select_rows(rows: Sequence[str], *, pattern: str,
                default: Callable[[list[pathlib.Path]], list[pathlib.Path]] | None = None
                ) -> list[pathlib.Path]:
    """``--rows``: 'all' (every ``pattern`` flagfile), names or paths, or (empty) `default(all)`."""
    every = sorted(CONFIG_DIR.glob(pattern))
    if list(rows) == ["all"]:
        return every
    if rows:
        return [resolve_config(r) for r in rows]
    return default(every) if default else every


def _flag_name(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0]


def row_arguments(argv: Sequence[str], runner_flags: Iterable[str]) -> list[str]:
    """The flags of a runner's command line (flagfiles already expanded) that go to every row:
    every ``-``-argument whose name is not one of `runner_flags` (the runner's own, absl's)."""
    own = set(runner_flags)
    out = []
    for a in argv:
        name = _flag_name(a)
        if a.startswith("-") and name not in own and not (name.startswith("no") and name[2:] in own):
            out.append(a)
    return out


def finished_record(run_dir: pathlib.Path, arguments: Sequence[str]) -> dict | None:
    """The record of a row that finished in `run_dir` with these arguments, else None."""
    results, row = run_dir / "results.json", run_dir / ROW_RECORD
    if not (results.is_file() and row.is_file()):
        return None
    try:
        if json.loads(row.read_text())["arguments"] != list(arguments):
            return None
        return json.loads(results.read_text())
    except (ValueError, KeyError, OSError):
        return None


def run_table(configs: Sequence[pathlib.Path], run_row: Callable[[pathlib.Path, list[str]], dict], *,
              overrides: Sequence[str] = (), runs_dir=None,
              extra_arguments: Callable[[pathlib.Path], list[str]] | None = None,
              resume: bool = True, announce: Callable[[pathlib.Path, dict, bool], None] | None = None,
              is_chief: Callable[[], bool] = lambda: True,
              share_key: Callable[[pathlib.Path, list[str]], Hashable | None] | None = None,
              share: Callable[[pathlib.Path, list[str], dict], dict] | None = None) -> list[dict]:
    """Runs (or, with `resume`, reuses) every row; returns their records in order.

    Each row gets ``[*overrides, *extra_arguments(cfg), --run_dir=<run_folder(runs_dir, cfg)>]``.
    A ``--run_dir`` among the overrides is taken as the parent folder (like `runs_dir`);
    ``--out_json`` is the table's, never a row's. `announce(cfg, record, reused)` prints a row.
    Rows of one `share_key` share the first one's run through `share` (module docstring).
    """
    parent = runs_dir
    kept = []
    for o in overrides:
        if o.startswith("--run_dir="):
            parent = parent or o.split("=", 1)[1]
        elif not o.startswith("--out_json="):
            kept.append(o)
    records, shared = [], {}
    for cfg in configs:
        cfg = resolve_config(cfg)
        run_dir = run_folder(parent, cfg)
        arguments = [*kept, *(extra_arguments(cfg) if extra_arguments else []), f"--run_dir={run_dir}"]
        record = finished_record(run_dir, arguments) if resume else None
        reused = record is not None
        key = share_key(cfg, arguments) if share_key else None
        if reused:
            print(f"\n=== {cfg.name}: finished earlier, reusing {run_dir}/results.json "
                  "(--noresume runs it again)", flush=True)
        elif key is not None and key in shared:
            first_cfg, first = shared[key]
            print(f"\n=== {cfg.name}: shares the run of {first_cfg.name}", flush=True)
            record = share(cfg, arguments, first)
        else:
            print(f"\n=== {cfg.name}", flush=True)
            record = run_row(cfg, arguments)
        if key is not None:
            shared.setdefault(key, (cfg, record))
        if not reused and is_chief():
            json_files.write_json(run_dir / ROW_RECORD, {"flagfile": str(cfg), "arguments": arguments})
        if announce:
            announce(cfg, record, reused)
        records.append(record)
    return records


def next_command(run_dir: str | pathlib.Path, *commands: str, load_run: bool = True) -> str:
    """The lines an experiment prints last: what to run next on its run folder (`commands`, then,
    with `load_run`, the notebook line that loads the run and evaluates it again)."""
    lines = [f"Run folder: {run_dir}", "Next:"]
    lines += [f"  {c}" for c in commands]
    if load_run:
        lines.append(f'  python -c "from tf_twobranch.runs import load_run; r = load_run(\'{run_dir}\'); '
                     'print(r.model.evaluate(r.evaluation_split()))"')
    return "\n".join(lines)
