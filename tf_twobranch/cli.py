"""Shared entry-point behaviour of the package's command-line tools."""
from __future__ import annotations

import sys
from typing import Callable, NoReturn

from absl import flags

from tf_twobranch.errors import UserInputError


def exit_with_user_error(err: Exception) -> NoReturn:
    """A user's mistake is one clear line on stderr and exit status 2, no traceback."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def absl_main(run: Callable[[], object]) -> Callable[[list], None]:
    """An `absl.app.run` main that rejects stray arguments and reports user errors."""
    def main(argv) -> None:
        if len(argv) > 1:
            exit_with_user_error(f"unexpected arguments {argv[1:]}")
        try:
            run()
        except UserInputError as err:
            exit_with_user_error(err)
    return main


def parse_flags(argv: list[str]) -> list[str]:
    """`absl.app.run`'s flags_parser: a bad flag is one `error:` line and exit status 2.

    absl's own parser prints a FATAL line and exits 1; a flag read from a
    flagfile is reported with the flagfile's name.
    """
    try:
        return flags.FLAGS(argv)
    except flags.Error as err:
        flagfiles = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--flagfile=")]
        where = f" (flags read from {', '.join(flagfiles)})" if flagfiles else ""
        exit_with_user_error(f"{err}{where}")
