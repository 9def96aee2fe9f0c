"""Who is told when a model is fitted: the one hook the leaderboard times rows with.

The package trains a system in two ways, the one trainer (`trainer.train`) and a closed-form
fit (the CCA baseline's ``fit``); both are marked `reports_fit`. Inside `listening(listener)`
each such call tells ``listener.started(start)`` and ``listener.finished(start, end, params)``
(seconds of `time.perf_counter`, the fitted object's weight count), so a caller can time a
row without knowing which system it runs.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Iterator

__all__ = ["reports_fit", "listening", "model_params"]

_LISTENERS: list = []


def model_params(model) -> int | None:
    """Every weight of a Keras model (frozen ones included), or None when it has none to count."""
    try:
        return int(model.count_params())
    except (AttributeError, ValueError):
        return None


def reports_fit(count_params: Callable[[object], int | None]):
    """Marks a fit whose first argument is what gets fitted (`count_params` counts its weights)."""
    def decorate(fit):
        @functools.wraps(fit)
        def wrapper(*args, **kwargs):
            if not _LISTENERS:
                return fit(*args, **kwargs)
            start = time.perf_counter()
            for listener in list(_LISTENERS):
                listener.started(start)
            try:
                return fit(*args, **kwargs)
            finally:
                end = time.perf_counter()
                params = count_params(args[0]) if args else None
                for listener in list(_LISTENERS):
                    listener.finished(start, end, params)
        return wrapper
    return decorate


@contextlib.contextmanager
def listening(listener) -> Iterator[None]:
    """Reports every `reports_fit` call inside the block to `listener`."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)
