"""Heat-map pictures of an N-pair localization row (Das et al., Figs. 1, 3 and 5): the image, then
per phrase its heat map over the image with a colour bar, the pointing game's maximum (a cross
drawn wholly inside the image) and the phrase's ground-truth boxes. No flags:
`experiments.npair_draw` is the command. matplotlib is imported only when a figure is drawn.
"""
from __future__ import annotations

import pathlib
import textwrap
from typing import Sequence

import numpy as np

from tf_twobranch.evaluation import pointing_game

# Characters per title line of one 3.2-inch panel at 8 pt (wrapped, never clipped).
TITLE_CHARS = 34


def marker_arm(width: int, height: int) -> float:
    """Half the length of the cross's arms, in pixels of the image (6 % of its smaller side, >= 1)."""
    return max(1.0, 0.06 * min(width, height))


def marker_position(x: float, y: float, width: int, height: int, arm: float) -> tuple[float, float]:
    """Where the cross is drawn: the maximum's pixel, moved inwards just enough that the whole cross
    (arms of `arm` pixels) lies inside the image. Only the drawing moves: the pointing game reads
    the pixel itself."""
    def clamp(v, size):
        low, high = -0.5 + arm, size - 0.5 - arm
        return float(np.clip(v, low, high)) if low <= high else (size - 1) / 2
    return clamp(x, width), clamp(y, height)


def wrap_title(text: str, chars: int = TITLE_CHARS) -> str:
    """The title broken into lines of at most `chars` characters (long words are split)."""
    return "\n".join(textwrap.wrap(text, width=chars)) or text


def draw_phrase_heat_maps(image: np.ndarray, queries: Sequence, heat_maps: Sequence[np.ndarray | None],
                          path, *, title: str = "") -> pathlib.Path:
    """One PNG: the image (titled with the caption, wrapped), then per phrase its heat map over the
    image with its colour bar (the map's values, upsampled as the pointing game reads them), the
    pointing-game maximum (a white cross) and the phrase's ground-truth boxes (green: hit, red: miss)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.patches import Rectangle

    path = pathlib.Path(path)
    panels = len(queries) + 1
    titles = [wrap_title(title or "image")] + [None] * len(queries)
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 4.2), squeeze=False)
    height, width = image.shape[:2]
    extent = (-0.5, width - 0.5, height - 0.5, -0.5)
    for ax in axes[0]:
        ax.imshow(image, extent=extent)
    for k, (ax, query, heat) in enumerate(zip(axes[0, 1:], queries, heat_maps), start=1):
        hit = False
        if heat is not None:
            up = pointing_game.upsample_heat_map(heat, query.image_height, query.image_width)
            shown = ax.imshow(up, cmap="jet", alpha=0.45, extent=(-0.5, query.image_width - 0.5,
                                                                  query.image_height - 0.5, -0.5))
            # The bar in full colour (the overlay is translucent so that the image shows through).
            bar = fig.colorbar(ScalarMappable(norm=shown.norm, cmap=shown.cmap), ax=ax, fraction=0.046, pad=0.03)
            bar.set_label("heat-map score", fontsize=7)
            bar.ax.tick_params(labelsize=6)
            x, y = pointing_game.heat_map_maximum(heat, query.image_height, query.image_width)
            hit = pointing_game.point_hits_boxes(x, y, query.boxes)
            arm = marker_arm(query.image_width, query.image_height)
            cx, cy = marker_position(x, y, query.image_width, query.image_height, arm)
            for dx, dy in ((1, 1), (1, -1)):
                ax.plot([cx - dx * arm, cx + dx * arm], [cy - dy * arm, cy + dy * arm], color="white",
                        linewidth=2.5, solid_capstyle="butt", gid="argmax_marker")
        for x1, y1, x2, y2 in np.asarray(query.boxes):
            ax.add_patch(Rectangle((x1 - 0.5, y1 - 0.5), x2 - x1 + 1, y2 - y1 + 1, fill=False,
                                   edgecolor="lime" if hit else "red", linewidth=2))
        verdict = "no map" if heat is None else ("hit" if hit else "miss")
        titles[k] = wrap_title(f"{query.phrase!r}: {verdict}")
    for ax, text in zip(axes[0], titles):
        ax.set_title(text, fontsize=8, loc="center", wrap=False)
        ax.set_xlim(extent[0], extent[1])
        ax.set_ylim(extent[2], extent[3])
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
