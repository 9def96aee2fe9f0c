"""Shared entry-point behaviour of the package's command-line tools."""
from __future__ import annotations

import os
import re
import sys
from typing import Callable, NamedTuple, NoReturn, Sequence

from absl import flags

from tf_twobranch.data.formats._common import read_text
from tf_twobranch.errors import ConfigError, UserInputError

COMMAND_LINE = "on the command line"


def exit_with_user_error(err: Exception) -> NoReturn:
    """A user's mistake is one clear line on stderr and exit status 2, no traceback."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def absl_main(run: Callable[[], object]) -> Callable[[list], None]:
    """An `absl.app.run` main that rejects stray arguments and reports user errors.

    With ``--deterministic`` (`deterministic_requested`) TensorFlow's op
    schedule is fixed here, before the run's first op
    (`trainer.serialize_op_scheduling`).
    """
    def main(argv) -> None:
        if len(argv) > 1:
            exit_with_user_error(f"unexpected arguments {argv[1:]}")
        if deterministic_requested(flags.FLAGS, sys.argv[1:]):
            from tf_twobranch.training.trainer import serialize_op_scheduling  # TensorFlow only when asked
            serialize_op_scheduling()
        try:
            run()
        except UserInputError as err:
            exit_with_user_error(err)
    return main


def deterministic_requested(fv: flags.FlagValues, args: Sequence[str]) -> bool:
    """``--deterministic`` as the tool parsed it, or, for a table runner that passes it on to its
    rows without defining it, the last ``--[no]deterministic[=bool]`` of its command line and
    flagfiles (`args`). A row flagfile's own ``--deterministic`` is not seen here: TensorFlow has
    started by the time the row is parsed, so that row warns instead."""
    if "deterministic" in fv:
        return bool(fv["deterministic"].value)
    try:
        arguments = expand_flagfiles(list(args))
    except UserInputError:
        return False          # the tool reports its bad flagfile itself
    wanted = False
    for argument in arguments:
        text = argument.text
        if text == "--":
            break
        name, _, value = text.lstrip("-").partition("=")
        if name == "deterministic":
            try:
                wanted = flags.BooleanParser().parse(value) if value else True
            except ValueError:
                wanted = False    # the row that parses it reports the bad value
        elif name == "nodeterministic":
            wanted = False
    return wanted


def split_paths(flag: str, values) -> dict[str, str]:
    """``--<flag>=train=path,test=path`` as {split: path} (empty: {})."""
    out = {}
    for item in values or ():
        split, sep, path = item.partition("=")
        if not sep or split not in ("train", "val", "test") or not path:
            raise UserInputError(f"--{flag} takes split=path pairs (train=..., test=...), got {item!r}")
        out[split] = path
    return out


class Argument(NamedTuple):
    """One command-line argument and where it was written (for error messages)."""
    text: str
    origin: str = COMMAND_LINE
    flagfile: str | None = None


def _flagfile_name(args: Sequence[str], index: int) -> tuple[str | None, int]:
    """(file name, arguments used) when args[index] is a --flagfile directive, else (None, 1)."""
    arg = args[index]
    if arg in ("--flagfile", "-flagfile"):
        if index + 1 == len(args):
            raise ConfigError(f"{arg} needs a file name")
        return os.path.expanduser(args[index + 1]), 2
    for prefix in ("--flagfile=", "-flagfile="):
        if arg.startswith(prefix):
            return os.path.expanduser(arg[len(prefix):].strip()), 1
    return None, 1


def _flagfile_arguments(path: str, stack: tuple[str, ...]) -> list[Argument]:
    if path in stack:
        raise ConfigError(f"{path}: the flagfile includes itself (through {' -> '.join(stack)})")
    arguments = []
    # read_text, not absl's reader: a flagfile saved with a byte-order mark starts with it.
    for line_number, line in enumerate(read_text(path).splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith(("#", "//")):
            continue
        nested, _ = _flagfile_name([text], 0)
        if nested is not None:
            arguments += _flagfile_arguments(nested, (*stack, path)) if nested else []
        else:
            arguments.append(Argument(text, f"in {path}, line {line_number}", path))
    return arguments


def expand_flagfiles(args: Sequence[str], origin: str = COMMAND_LINE) -> list[Argument]:
    """`args` with each ``--flagfile=F`` replaced by F's flags, as absl expands them (comments
    '#' and '//', nested flagfiles, nothing after '--'), each flag with where it was written.

    Flagfiles are read as UTF-8 with or without a byte-order mark; a missing or unreadable
    one is a UserInputError naming it.
    """
    arguments, index = [], 0
    while index < len(args):
        if args[index] == "--":
            arguments += [Argument(a, origin) for a in args[index:]]
            break
        path, used = _flagfile_name(args, index)
        if path is None:
            arguments.append(Argument(args[index], origin))
        elif path:  # absl ignores an empty --flagfile=
            arguments += _flagfile_arguments(path, ())
        index += used
    return arguments


def _flag_name(text: str) -> str:
    return text.lstrip("-").split("=", 1)[0]


def describe_flag_error(err: flags.Error, fv: flags.FlagValues, arguments: Sequence[Argument]) -> str:
    """absl's message with where the flag was written and, for an unknown flag, the defined
    flags whose names contain it (e.g. --epochs -> --stage1_epochs, --stage2_epochs)."""
    message = str(err)
    name = getattr(err, "flagname", None)
    if name is None:
        found = re.search(r"flag --(\w+)", message)
        name = found.group(1) if found else None
    origins = [a.origin for a in arguments if name is not None and _flag_name(a.text) in (name, f"no{name}")]
    if origins:
        message += f" ({origins[-1]})"
    else:
        flagfiles = sorted({a.flagfile for a in arguments if a.flagfile})
        if flagfiles:
            message += f" (flags read from {', '.join(flagfiles)})"
    if isinstance(err, flags.UnrecognizedFlagError) and "Did you mean" not in message:
        similar = sorted(n for n in fv if name and len(name) > 2 and name in n and n != name)
        if similar:
            message += f"; did you mean {' or '.join(f'--{n}' for n in similar[:8])}?"
    return message


def parse_flags(argv: list[str]) -> list[str]:
    """`absl.app.run`'s flags_parser: a bad flag is one `error:` line and exit status 2.

    absl's own parser prints a FATAL line and exits 1. Flagfiles are expanded
    here (see `expand_flagfiles`), so the error names the flagfile and line
    (or the command line) where the flag was written.
    """
    try:
        arguments = expand_flagfiles(argv[1:])
    except UserInputError as err:
        exit_with_user_error(err)
    try:
        return flags.FLAGS([argv[0], *(a.text for a in arguments)])
    except flags.Error as err:
        exit_with_user_error(describe_flag_error(err, flags.FLAGS, arguments))
