"""User-facing errors.

Every error caused by a user's input (a file, a record, a flag) is raised as a
subclass of `UserInputError`, whose message names where the problem is and
what was expected, so that experiments can print it without a traceback.
"""
from __future__ import annotations


class UserInputError(ValueError):
    """A problem with the user's input, reported without a traceback."""


class DataFormatError(UserInputError):
    """A file does not have the expected on-disk format.

    Args:
      path: the file (or directory) at fault.
      message: what is wrong and what was expected.
      line: 1-based line number, when the format is line-oriented.
      record: a record identifier (JSON index, image id, HDF5 dataset, ...).
    """

    def __init__(self, path, message: str, *, line: int | None = None, record=None):
        self.path = str(path)
        self.line = line
        self.record = record
        where = self.path
        if line is not None:
            where += f", line {line}"
        if record is not None:
            where += f", record {record!r}"
        super().__init__(f"{where}: {message}")


class ConfigError(UserInputError):
    """A flag or configuration value is unknown or out of range."""
