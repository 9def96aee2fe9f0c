"""Figures of the papers, drawn from runs and exports (no flags).

Every draw tool names its files after itself (`figure_path`), so the README's one
``--out_dir=figures`` holds the pictures of every tool side by side, none overwriting another's.
"""
from __future__ import annotations

import os
import pathlib
import re
from typing import Sequence

#: The file-name prefix of each draw tool's pictures.
TOOL_PREFIXES = {"two_branch_draw": "region_phrase", "fragments_draw": "fragments",
                 "npair_draw": "heat_maps"}


def figure_path(out_dir: str | os.PathLike, tool: str, image_id: str, suffix: str = "") -> pathlib.Path:
    """``<out_dir>/<tool prefix>_<image id><suffix>.png`` (the id made safe for a file name)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(image_id))
    return pathlib.Path(out_dir) / f"{TOOL_PREFIXES[tool]}_{safe}{suffix}.png"


def wrote_message(paths: Sequence, out_dir) -> str:
    """'Wrote 1 picture to …' / 'Wrote 3 pictures to …'."""
    return f"Wrote {len(paths)} picture{'' if len(paths) == 1 else 's'} to {out_dir}"
