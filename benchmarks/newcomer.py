"""The newcomer's first hour: every command block of README.md and docs/SERVING.md, as written.

Run from the repository root:

    python -m benchmarks.newcomer                       # clone HEAD, fresh venv, everything
    python -m benchmarks.newcomer --list                # the commands it would run, with skips
    python -m benchmarks.newcomer --sections 'tf_twobranch,Deep fragment embeddings' \
        [--venv <existing venv>] [--workdir <folder>] [--keep_going]

A clean clone of the committed HEAD in a temporary folder, a fresh virtual
environment (`python -m venv`; `pip` and `python` in the commands are that
environment's), and then every fenced ``bash``/``sh`` block (one logical
command at a time: continuation lines joined, ``&&`` chains kept whole) and
every ``python`` block (given to ``python -`` as written) of the two files,
in order, in the clone's root. Nothing is appended to a command. A block is
left out only under a ``<!-- newcomer: skip: <reason> -->`` line right above
its fence (a marker without a reason is an error). Per command: exit code,
wall seconds and the peak memory of its process tree (the summed proportional
set size of the command and its descendants, sampled every 0.2 s). The run stops at the first
failing command (``--keep_going`` runs the rest) and exits non-zero then, or
when any command passed `--max_gb`. Not a unit test: the README's main
job, its test suite, the tables and the three-seed leaderboard take about
five hours on 2 cores.

Every finished command is recorded in ``<workdir>/newcomer_ledger.json``
with the clone's commit. ``--resume`` (with the same ``--workdir``) keeps the
clone, its venv and its data and skips the commands the ledger records as
passed at that commit (a failed one runs again), so a run longer than one
sitting goes on where it stopped; the table then lists every command, the earlier ones with
their recorded figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/SERVING.md")
SKIP = re.compile(r"<!--\s*newcomer:\s*skip\b:?\s*(.*?)\s*-->")
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "bash", "python": "python"}


ASSIGNMENT = re.compile(r"^(export\s+)?[A-Za-z_][A-Za-z0-9_]*=\S*$")


@dataclasses.dataclass
class Command:
    document: str
    section: str
    line: int
    kind: str            # "bash" or "python"
    text: str
    skip: str | None     # the marker's reason; None without a marker
    prelude: str = ""    # the block's variable assignments above this command (`D=...`), run first


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:          # an open quotation: a multi-line `python -c "..."`
        return False
    return not text.rstrip().endswith("\\")


def _logical_lines(code: str) -> list[tuple[int, str]]:
    """(offset, command) of a shell block: continuation lines and open quotations joined as the
    shell joins them; blank and comment lines dropped."""
    out, pending, start = [], None, 0
    for offset, line in enumerate(code.splitlines()):
        if pending is None:
            start, text = offset, line
        elif pending.rstrip().endswith("\\"):
            text = pending.rstrip()[:-1].rstrip() + " " + line.strip()
        else:
            text = pending + "\n" + line
        if not _complete(text):
            pending = text
            continue
        pending = None
        if text.strip() and not text.strip().startswith("#"):
            out.append((start, text.strip()))
    if pending is not None:
        out.append((start, pending.strip()))
    return out


def document_commands(path: pathlib.Path, name: str | None = None) -> list[Command]:
    """The runnable commands of one Markdown file, in order, with their skip markers."""
    name = name or path.name
    out, section, fence, body, markers = [], "", None, [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            heading = re.match(r"(#+) (.*)", line)
            if heading and len(heading.group(1)) <= 2:
                section = heading.group(2).strip()
            if line.startswith("```"):
                reasons = [m.group(1) for m in map(SKIP.search, markers) if m]
                fence = (line[3:].strip() or "text", number, reasons[-1] if reasons else None)
                body = []
            elif line.strip().startswith("<!--"):
                markers.append(line)
            elif line.strip():
                markers = []
            continue
        if not line.startswith("```"):
            body.append(line)
            continue
        lang, start, skip = fence
        fence, markers = None, []
        kind = RUNNABLE.get(lang)
        if kind == "bash":
            prelude = ""
            for offset, text in _logical_lines("\n".join(body)):
                out.append(Command(name, section, start + 1 + offset, kind, text, skip, prelude))
                if ASSIGNMENT.match(text):
                    prelude += text + "\n"
        elif kind == "python":
            out.append(Command(name, section, start + 1, kind, "\n".join(body) + "\n", skip))
    return out


def all_commands(root: pathlib.Path = REPO) -> list[Command]:
    return [c for doc in DOCUMENTS for c in document_commands(root / doc, doc)]


# --------------------------------------------------------------------------- running

def _children(pid: int, table: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += table.get(p, [])
    return out


def _pss_bytes(pid: int) -> int:
    """Proportional set size (shared pages divided among their sharers); RSS where smaps_rollup is missing."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def tree_memory_bytes(pid: int) -> int:
    """Summed proportional set size of `pid` and its descendants: the memory the tree holds, each
    shared page counted once (forked test processes share most of theirs, so summed RSS overstates)."""
    table: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                table.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return sum(_pss_bytes(p) for p in _children(pid, table))


def run_command(command: Command, cwd: pathlib.Path, env: dict, log, timeout: float) -> dict:
    argv = ["bash", "-e", "-o", "pipefail", "-c", command.prelude + command.text] if command.kind == "bash" else ["python", "-"]
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.PIPE if command.kind == "python" else subprocess.DEVNULL,
                            text=True)
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.2):
            peak[0] = max(peak[0], tree_memory_bytes(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        if command.kind == "python":
            proc.stdin.write(command.text)
            proc.stdin.close()
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    finally:
        done.set()
        sampler.join()
    return {"rc": rc, "seconds": time.perf_counter() - started, "peak_gb": peak[0] / 1e9}


def _environment(venv: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TF_TWOBRANCH_DATA", "TF_TWOBRANCH_RUNS", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def command_key(command: Command) -> str:
    """What identifies a command in the ledger: where it is and what it says."""
    return f"{command.document}:{command.line}:{command.text}"


def read_ledger(path: pathlib.Path, commit: str) -> dict:
    """The ledger's passed commands at `commit` (key -> row); {} for another commit or no ledger."""
    if not path.is_file():
        return {}
    from tf_twobranch.json_files import read_json_object

    ledger = read_json_object(path, "newcomer ledger")
    return ledger.get("passed", {}) if ledger.get("commit") == commit else {}


def _short(text: str, width: int = 78) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the commands and skips; run nothing")
    parser.add_argument("--sections", default="", help="comma-separated section headings to run (commas inside a "
                        "heading's parentheses stay; default: all)")
    parser.add_argument("--workdir", default="", help="where the clone goes (default: a temporary folder)")
    parser.add_argument("--venv", default="", help="an existing virtual environment instead of a fresh one")
    parser.add_argument("--keep_going", action="store_true", help="run the rest after a failure")
    parser.add_argument("--resume", action="store_true", help="with --workdir: skip the commands its ledger "
                        "records as passed at the clone's commit")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds per command")
    parser.add_argument("--max_gb", type=float, default=8.0, help="a command above this fails the run")
    parser.add_argument("--out_json", default=str(REPO / "benchmarks/results/newcomer.json"))
    args = parser.parse_args(argv)

    commands = all_commands()
    unexplained = [c for c in commands if c.skip == ""]
    if unexplained:
        for c in unexplained:
            print(f"{c.document}:{c.line}: a newcomer skip marker needs a reason", file=sys.stderr)
        return 2
    # A comma inside parentheses belongs to a heading ("Phrase localization (Table 1, Table 5, Fig. 2)").
    wanted = {s.strip() for s in re.split(r",(?![^()]*\))", args.sections) if s.strip()}
    if args.list:
        for c in commands:
            state = f"SKIP ({c.skip})" if c.skip is not None else "run"
            print(f"{c.document}:{c.line} [{c.section}] {state}: {_short(c.text)}")
        return 0

    from benchmarks import common
    from tf_twobranch.json_files import write_json

    report, lines, started = common.start_report(sections=sorted(wanted) or "all")
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="newcomer-"))
    clone = work / "tf_twobranch"
    if not clone.exists():
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    report["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                                      text=True).stdout.strip()
    venv = pathlib.Path(args.venv) if args.venv else work / "venv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = _environment(venv)
    if args.resume and not args.workdir:
        parser.error("--resume needs the --workdir of the run it continues")
    ledger_path = work / "newcomer_ledger.json"
    passed = read_ledger(ledger_path, report["commit"]) if args.resume else {}
    if not args.resume or not passed:
        write_json(ledger_path, {"commit": report["commit"], "passed": {}})
    rows, failed = [], False
    log_path = work / "newcomer.log"
    print(f"clone {clone} at {report['commit'][:10]}, venv {venv}, log {log_path}", flush=True)
    with open(log_path, "a", encoding="utf-8") as log:
        for c in all_commands(clone):
            if wanted and c.section not in wanted:
                continue
            where = f"{c.document}:{c.line}"
            if c.skip is not None:
                rows.append([where, _short(c.text, 60), "skip", "", "", c.skip])
                continue
            if command_key(c) in passed:
                rows.append(passed[command_key(c)])
                print(f"{where}: passed before (ledger): {_short(c.text, 70)}", flush=True)
                continue
            if failed and not args.keep_going:
                rows.append([where, _short(c.text, 60), "not run", "", "", "after a failure"])
                continue
            log.write(f"\n===== {where} [{c.section}]\n{c.text}\n")
            log.flush()
            r = run_command(c, clone, env, log, args.timeout)
            ok = r["rc"] == 0 and r["peak_gb"] <= args.max_gb
            failed |= not ok
            rows.append([where, _short(c.text, 60), r["rc"], round(r["seconds"], 1), round(r["peak_gb"], 2),
                         "" if ok else ("over --max_gb" if r["rc"] == 0 else f"see {log_path}")])
            if ok:  # with --keep_going, a pass after an earlier failure is recorded too: its own result
                passed[command_key(c)] = rows[-1]
                write_json(ledger_path, {"commit": report["commit"], "passed": passed})
            print(f"{where}: rc {r['rc']}, {r['seconds']:.0f} s, peak {r['peak_gb']:.2f} GB: "
                  f"{_short(c.text, 70)}", flush=True)
    lines.append(common.format_table(["where", "command", "rc", "seconds", "peak PSS GB", "note"], rows,
                                     title=f"README and SERVING.md as written (commit {report['commit'][:10]})"))
    report["rows"] = rows
    report["passed"] = not failed
    common.finish_report(report, lines, started, args.out_json)
    (pathlib.Path(args.out_json).with_suffix(".md")).write_text(
        "\n".join(["| where | command | rc | s | peak PSS GB | note |", "|---|---|---|---|---|---|"] +
                  ["| " + " | ".join(str(v).replace("|", "\\|") for v in r) + " |" for r in rows]) + "\n",
        encoding="utf-8")
    write_json(args.out_json, report)
    print("PASSED" if not failed else "FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
