"""Shared entry-point behaviour of the package's command-line tools."""
from __future__ import annotations

import sys
from typing import Callable, NoReturn

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
