"""A built-in, dependency-free region-proposal generator ("EdgeBoxes-lite").

The two-branch paper ranks 200 EdgeBox proposals per image (Zitnick & Dollár
2014).  When no proposals are available for an image this module generates a
deterministic substitute with numpy/scipy only.  It is *not* EdgeBoxes (no
structured-forest edges, no edge grouping), so its recall is lower; use real
proposals (see :mod:`tf_twobranch.data.formats.proposals`) for paper numbers.

Algorithm, on a copy of the image resized so its long side is at most
``work_size`` pixels:

1. Edge map: Gaussian smoothing, per-channel Sobel gradient magnitude, max
   over channels, normalised to [0, 1] and soft-thresholded to suppress noise.
2. Candidates:

   * multi-scale sliding windows (several sizes and aspect ratios, stride a
     quarter of the window);
   * bounding boxes of connected components of (a) colour-quantised regions
     and (b) salient regions (colour far from the image's median colour) at
     several thresholds — these find whole objects;
   * seeded random jitter around the best candidates.
3. Score: EdgeBoxes' intuition — an object box has strong edges along its
   border but few edges crossing just outside it.  ``score = (mean edge in the
   inner border band − mean edge in the outer band) · sqrt(relative area)^0.25``.
4. Greedy non-maximum suppression (IoU 0.7, relaxed if too few survive);
   the top ``num_proposals`` boxes, padded with seeded random boxes so that
   exactly ``num_proposals`` are returned.

Cost: about 7-10 ms of CPU per 96x96 image for 200 proposals (the geometry of
the sliding windows is computed once per image size, region components of
all codes are labelled in one pass, NMS stops after the top few hundred
candidates); :func:`generate_proposals_for_images` spreads images over
``num_workers`` processes.
"""
from __future__ import annotations

import functools
import concurrent.futures
import multiprocessing
import os
import sys
from typing import Iterable, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError
from scipy import ndimage

from tf_twobranch.boxes import clip_boxes, descending_order_prefix, non_max_suppression, validate_boxes
from tf_twobranch.data.formats.proposals import write_proposals
from tf_twobranch.errors import ConfigError, DataFormatError


def _edge_map(image: np.ndarray, sigma: float) -> np.ndarray:
    smoothed = ndimage.gaussian_filter(image, sigma=(sigma, sigma, 0))
    magnitude = np.zeros(image.shape[:2], np.float64)
    for channel in range(image.shape[2]):
        gx = ndimage.sobel(smoothed[:, :, channel], axis=1)
        gy = ndimage.sobel(smoothed[:, :, channel], axis=0)
        magnitude = np.maximum(magnitude, np.hypot(gx, gy))
    peak = np.percentile(magnitude, 99.5)
    if peak <= 0:
        return np.zeros_like(magnitude)
    magnitude = np.clip(magnitude / peak, 0, 1)
    # Soft threshold: background texture/noise contributes little.
    floor = np.percentile(magnitude, 60)
    return np.clip((magnitude - floor) / max(1e-6, 1 - floor), 0, 1)


def _integral(values: np.ndarray) -> np.ndarray:
    table = np.zeros((values.shape[0] + 1, values.shape[1] + 1), np.float64)
    table[1:, 1:] = values.cumsum(0).cumsum(1)
    return table


def _corner_indices(boxes: np.ndarray, width: int) -> np.ndarray:
    """(4, N) flat indices into an integral table (row stride ``width + 1``) of the corners
    that give the sums over inclusive integer boxes: ``t0 - t1 - t2 + t3``."""
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    stride = width + 1
    return np.stack([(y2 + 1) * stride + x2 + 1, y1 * stride + x2 + 1, (y2 + 1) * stride + x1, y1 * stride + x1])


class _ScoringPlan:
    """Everything of the box score that depends on the boxes only, not on the image."""

    def __init__(self, boxes: np.ndarray, height: int, width: int):
        boxes = np.round(boxes).astype(np.int64)
        box_w = boxes[:, 2] - boxes[:, 0] + 1
        box_h = boxes[:, 3] - boxes[:, 1] + 1
        band = np.maximum(1, np.round(0.1 * np.minimum(box_w, box_h))).astype(np.int64)
        inner = boxes + np.stack([band, band, -band, -band], axis=1)
        self.inner_valid = (inner[:, 2] >= inner[:, 0]) & (inner[:, 3] >= inner[:, 1])
        inner = np.where(self.inner_valid[:, None], inner, boxes)
        outer = boxes + np.stack([-band, -band, band, band], axis=1)
        outer[:, [0, 2]] = np.clip(outer[:, [0, 2]], 0, width - 1)
        outer[:, [1, 3]] = np.clip(outer[:, [1, 3]], 0, height - 1)

        def area(b):
            return ((b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)).astype(np.float64)

        # Rows 0-3: the box's corners, 4-7: the inner box's, 8-11: the outer box's.
        self.corners = np.concatenate([_corner_indices(b, width) for b in (boxes, inner, outer)])
        self.inner_band_area = np.maximum(area(boxes) - np.where(self.inner_valid, area(inner), 0.0), 1.0)
        self.outer_band_area = area(outer) - area(boxes)
        self.outer_band_divisor = np.maximum(self.outer_band_area, 1.0)
        self.area_factor = (area(boxes) / float(width * height)) ** 0.125
        for value in vars(self).values():
            value.flags.writeable = False

    def scores(self, edges_table: np.ndarray) -> np.ndarray:
        """``(mean edge in the inner band - mean edge in the outer band) * relative_area ** 0.125``."""
        c = edges_table.ravel()[self.corners]
        box_sum = c[0] - c[1] - c[2] + c[3]
        inner_sum = np.where(self.inner_valid, c[4] - c[5] - c[6] + c[7], 0.0)
        outer_sum = c[8] - c[9] - c[10] + c[11]
        inner_density = (box_sum - inner_sum) / self.inner_band_area
        outer_density = np.where(self.outer_band_area > 0, (outer_sum - box_sum) / self.outer_band_divisor, 0.0)
        return (inner_density - outer_density) * self.area_factor


def _score_boxes(edges_table: np.ndarray, boxes: np.ndarray, height: int, width: int) -> np.ndarray:
    """EdgeBoxes-style score of each box (see the module docstring) from the edge map's integral table."""
    return _ScoringPlan(boxes, height, width).scores(edges_table)


@functools.lru_cache(maxsize=16)
def _window_scoring_plan(height: int, width: int) -> _ScoringPlan:
    return _ScoringPlan(_sliding_windows(height, width), height, width)


@functools.lru_cache(maxsize=16)
def _sliding_windows_cached(height: int, width: int) -> np.ndarray:
    boxes = []
    short = min(height, width)
    for fraction in (0.1, 0.15, 0.22, 0.32, 0.45, 0.6, 0.8):
        for aspect in (0.5, 1.0, 2.0):  # width / height
            box_w = min(width, max(4, int(round(fraction * short * np.sqrt(aspect)))))
            box_h = min(height, max(4, int(round(fraction * short / np.sqrt(aspect)))))
            xs = np.unique(np.round(np.linspace(0, width - box_w, max(1, int(np.ceil(4 * (width - box_w) / box_w)) + 1))))
            ys = np.unique(np.round(np.linspace(0, height - box_h, max(1, int(np.ceil(4 * (height - box_h) / box_h)) + 1))))
            gx, gy = np.meshgrid(xs, ys)
            gx, gy = gx.ravel(), gy.ravel()
            boxes.append(np.stack([gx, gy, gx + box_w - 1, gy + box_h - 1], axis=1))
    boxes.append(np.array([[0, 0, width - 1, height - 1]], np.float64))
    windows = np.concatenate(boxes).astype(np.float64)
    windows.flags.writeable = False
    return windows


def _sliding_windows(height: int, width: int) -> np.ndarray:
    """Multi-scale windows (stride a quarter of the window); cached per image size (read-only)."""
    return _sliding_windows_cached(int(height), int(width))


# 4-connectivity inside each layer of a (layers, rows, cols) array, none across layers.
_LAYERED_CROSS = np.zeros((3, 3, 3), bool)
_LAYERED_CROSS[1] = ndimage.generate_binary_structure(2, 1)


def _opened(codes: np.ndarray) -> np.ndarray:
    """Union over code values >= 0 of the opening (3x3 cross) of ``layer == code``, per layer."""
    padded = np.pad(codes, ((0, 0), (1, 1), (1, 1)), constant_values=-2)
    centre = padded[:, 1:-1, 1:-1]
    # The openings of different codes are disjoint, and a pixel survives the
    # erosion of its own code's mask iff its 4 neighbours share its code
    # (outside the image counts as background).
    eroded = ((centre >= 0) & (centre == padded[:, :-2, 1:-1]) & (centre == padded[:, 2:, 1:-1])
              & (centre == padded[:, 1:-1, :-2]) & (centre == padded[:, 1:-1, 2:]))
    opened = eroded.copy()
    opened[:, 1:] |= eroded[:, :-1]
    opened[:, :-1] |= eroded[:, 1:]
    opened[:, :, 1:] |= eroded[:, :, :-1]
    opened[:, :, :-1] |= eroded[:, :, 1:]
    return opened


def _boxes_of_labels(labels: np.ndarray, count: int, min_pixels: int) -> list[tuple[int, int, int, int]]:
    sizes = np.bincount(labels.ravel(), minlength=count + 1)[1:]
    return [(cols.start, rows.start, cols.stop - 1, rows.stop - 1)
            for (_, rows, cols), size in zip(ndimage.find_objects(labels, count), sizes) if size >= min_pixels]


def _opened_component_boxes(codes: np.ndarray, min_pixels: int, *, binary: bool = False) -> np.ndarray:
    """Boxes of the connected regions of every code after a morphological opening.

    For each layer of ``codes`` (L, H, W) and each code value >= 0 in it, the
    mask ``layer == code`` is opened with a 3x3 cross (outside the image counts
    as background) and split into 4-connected components; the bounding boxes
    [x1, y1, x2, y2] of components with at least ``min_pixels`` pixels are
    returned (float64, unordered, possibly repeated).  Negative codes are
    background; ``binary=True`` promises a single code per layer.  Equivalent
    to ``binary_opening`` + ``label`` per code and layer, in a constant number
    of array passes instead of one pass per code.
    """
    layers, height, width = codes.shape
    opened = _opened(codes)
    if binary:
        labels, count = ndimage.label(opened, structure=_LAYERED_CROSS)
        return np.asarray(_boxes_of_labels(labels, count, min_pixels), np.float64).reshape(-1, 4)
    # Components of equal codes with one binary labelling: pixels sit on a
    # doubled grid, joined by a bridge cell only where two neighbours are both
    # opened and share a code.
    grid = np.zeros((layers, 2 * height - 1, 2 * width - 1), bool)
    grid[:, ::2, ::2] = opened
    grid[:, 1::2, ::2] = opened[:, :-1] & opened[:, 1:] & (codes[:, :-1] == codes[:, 1:])
    grid[:, ::2, 1::2] = opened[:, :, :-1] & opened[:, :, 1:] & (codes[:, :, :-1] == codes[:, :, 1:])
    labels, count = ndimage.label(grid, structure=_LAYERED_CROSS)
    # Every component has pixels (not only bridges), so the pixel grid alone
    # gives its size and bounding box.
    boxes = _boxes_of_labels(np.ascontiguousarray(labels[:, ::2, ::2]), count, min_pixels)
    return np.asarray(boxes, np.float64).reshape(-1, 4)


def _region_boxes(image: np.ndarray, min_pixels: int) -> np.ndarray:
    smoothed = ndimage.gaussian_filter(image, sigma=(2, 2, 0))
    # (a) colour-quantised regions.
    quantised_layers = []
    for levels in (3, 5):
        quantised = np.clip((smoothed * levels).astype(np.int8), 0, levels - 1)
        quantised_layers.append(quantised[:, :, 0] * levels * levels + quantised[:, :, 1] * levels + quantised[:, :, 2])
    # (b) salient regions: far from the median colour.
    distance = np.linalg.norm(smoothed - np.median(smoothed.reshape(-1, 3), axis=0), axis=2)
    thresholds = np.percentile(distance, (50, 70, 85, 93))
    salient_layers = np.where(distance[None] > thresholds[:, None, None], 0, -1).astype(np.int8)
    boxes = np.concatenate([_opened_component_boxes(np.stack(quantised_layers), min_pixels),
                            _opened_component_boxes(salient_layers, min_pixels, binary=True)])
    if not len(boxes):
        return np.zeros((0, 4), np.float64)
    return np.unique(boxes, axis=0)


def _random_boxes(rng: np.random.Generator, count: int, height: int, width: int) -> np.ndarray:
    box_w = rng.uniform(0.1, 1.0, count) * width
    box_h = rng.uniform(0.1, 1.0, count) * height
    x1 = rng.uniform(0, 1, count) * (width - box_w)
    y1 = rng.uniform(0, 1, count) * (height - box_h)
    return np.stack([x1, y1, x1 + box_w - 1, y1 + box_h - 1], axis=1)


def generate_proposals(image: np.ndarray, num_proposals: int = 200, seed: int = 0, *,
                       work_size: int = 192, nms_iou: float = 0.7) -> np.ndarray:
    """Returns float32 (num_proposals, 4) boxes [x1, y1, x2, y2] (0-based, inclusive), best first.

    Args:
      image: HxWx3 uint8 RGB image (HxW grayscale and HxWx4 are accepted).
      num_proposals: number of boxes returned (always exactly this many).
      seed: seed of the jitter/padding randomness; equal inputs give equal outputs.
      work_size: long side of the downscaled copy the boxes are computed on (smaller
        images are processed at their own size, never upscaled).
      nms_iou: IoU above which a lower-scored candidate is suppressed.
    """
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] not in (3, 4) or min(array.shape[:2]) < 2:
        raise ValueError(f"expected an HxWx3 image, got shape {array.shape}")
    if num_proposals < 1:
        raise ValueError("num_proposals must be positive")
    array = array[:, :, :3]
    height, width = array.shape[:2]
    rng = np.random.default_rng(seed)

    scale = min(1.0, work_size / max(height, width))
    if scale < 1.0:
        zoom = (max(2, round(height * scale)) / height, max(2, round(width * scale)) / width, 1)
        small = ndimage.zoom(array.astype(np.float64) / 255.0, zoom, order=1)
    else:
        zoom = (1.0, 1.0, 1)
        small = array.astype(np.float64) / 255.0
    small_h, small_w = small.shape[:2]

    edges = _edge_map(small, sigma=1.0)
    table = _integral(edges)
    min_pixels = max(6, int(0.0015 * small_h * small_w))
    windows = _sliding_windows(small_h, small_w)
    regions = _region_boxes(small, min_pixels)
    candidates = np.concatenate([windows, regions])
    scores = np.concatenate([_window_scoring_plan(small_h, small_w).scores(table),
                             _score_boxes(table, regions, small_h, small_w)])

    # Jitter the best candidates to refine their borders.
    top = candidates[descending_order_prefix(scores, 150)]
    widths = (top[:, 2] - top[:, 0] + 1)[:, None]
    heights = (top[:, 3] - top[:, 1] + 1)[:, None]
    jitter = []
    for _ in range(4):
        noise = rng.normal(0, 0.07, size=top.shape)
        jitter.append(top + noise * np.concatenate([widths, heights, widths, heights], axis=1))
    jitter = clip_boxes(np.concatenate(jitter), small_w, small_h).astype(np.float64)
    jitter = np.round(jitter)
    jitter = jitter[(jitter[:, 2] > jitter[:, 0]) & (jitter[:, 3] > jitter[:, 1])]
    candidates = np.concatenate([candidates, jitter])
    scores = np.concatenate([scores, _score_boxes(table, jitter, small_h, small_w)])

    # Region boxes outline whole segments, which windows rarely match; the best
    # of them (up to half the budget, and their jittered copies) go first.
    priority = scores.copy()
    region_slice = np.arange(len(windows), len(windows) + len(regions))
    best_regions = region_slice[np.argsort(-scores[region_slice], kind="stable")[: num_proposals // 2]]
    priority[best_regions] += 10.0
    kept = non_max_suppression(candidates, priority, nms_iou, max_output=num_proposals)
    if len(kept) < num_proposals:  # too few distinct boxes: relax NMS, keep order.
        rest = np.setdiff1d(np.argsort(-scores, kind="stable"), kept, assume_unique=True)
        order = np.argsort(-scores[rest], kind="stable")
        kept = np.concatenate([kept, rest[order][: num_proposals - len(kept)]])
    boxes = candidates[kept]
    if len(boxes) < num_proposals:
        boxes = np.concatenate([boxes, _random_boxes(rng, num_proposals - len(boxes), small_h, small_w)])

    # Back to original pixel coordinates (inclusive pixel edges).
    boxes = boxes.copy()
    sx, sy = 1.0 / zoom[1], 1.0 / zoom[0]
    boxes[:, [0, 2]] = np.stack([boxes[:, 0] * sx, (boxes[:, 2] + 1) * sx - 1], axis=1)
    boxes[:, [1, 3]] = np.stack([boxes[:, 1] * sy, (boxes[:, 3] + 1) * sy - 1], axis=1)
    boxes = clip_boxes(np.round(boxes), width, height)
    return validate_boxes(boxes, width, height, record="generated proposals")


#: Below this many images per worker, starting worker processes costs more than it saves.
_MIN_IMAGES_PER_WORKER = 32
#: Chunks per worker: enough to balance the load, few enough to keep the messaging cheap.
_CHUNKS_PER_WORKER = 8


def _read_rgb(path: str) -> tuple[np.ndarray | None, str | None]:
    """``(pixels, None)``, or ``(None, what is wrong)`` when the file cannot be read as an image."""
    try:
        with Image.open(path) as handle:
            return np.asarray(handle.convert("RGB")), None
    except FileNotFoundError:
        return None, "image file not found"
    except (UnidentifiedImageError, OSError) as error:
        return None, f"cannot decode image: {error}"


def _proposals_for_paths(task: tuple[list[str], int, int]):
    """Worker: proposals of a chunk of image files, in order.

    Returns ``("ok", [boxes, ...])`` or, at the first bad image,
    ``("error", path, message)`` (plain values, so nothing depends on how
    exceptions pickle between processes).
    """
    paths, num_proposals, seed = task
    results = []
    for path in paths:
        pixels, problem = _read_rgb(path)
        if problem is not None:
            return "error", path, problem
        try:
            results.append(generate_proposals(pixels, num_proposals=num_proposals, seed=seed))
        except ValueError as error:
            return "error", path, f"cannot generate proposals: {error}"
    return "ok", results


# Entry points of this project, each guarded by `if __name__ == "__main__"`: a spawn worker
# re-imports the parent's __main__, which for an unguarded user script means running it again
# (a three-line script that loaded a run re-executed 29 times before it was killed).
_GUARDED_ENTRY_PACKAGES = ("experiments", "tf_twobranch", "benchmarks")


def spawn_pool_is_safe() -> bool:
    """True where a spawn process pool cannot re-run the user's script: this project's own
    `python -m` entry points, never inside a worker; elsewhere the generator uses threads."""
    if multiprocessing.parent_process() is not None:
        return False
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (getattr(spec, "name", None) or "").split(".")[0] in _GUARDED_ENTRY_PACKAGES


def default_num_workers() -> int:
    """Worker processes used by :func:`generate_proposals_for_images` by default: ``min(2, cpu count)``."""
    return max(1, min(2, os.cpu_count() or 1))


def generate_proposals_for_images(image_paths: Iterable[str | os.PathLike], out_path, num_proposals: int = 200,
                                  seed: int = 0, image_ids: Sequence[str] | None = None, *,
                                  num_workers: int | None = None) -> dict[str, np.ndarray]:
    """Generates proposals for each image file and writes them to ``out_path`` (HDF5 or directory).

    Image ids are the file names without extension unless ``image_ids`` is
    given.  Scores are the rank order (1 for the best box, decreasing).
    Returns the proposals written, in input order.

    ``num_workers`` processes (``multiprocessing`` spawn context, contiguous
    chunks of images; default :func:`default_num_workers`) share the work;
    the proposals do not depend on it.  Few images are processed in this
    process.  An unreadable image raises DataFormatError naming the first
    such file in input order.
    """
    image_paths = [os.fspath(p) for p in image_paths]
    if image_ids is None:
        image_ids = [os.path.splitext(os.path.basename(p))[0] for p in image_paths]
    image_ids = list(image_ids)
    if len(image_ids) != len(image_paths):
        raise ValueError("image_ids and image_paths differ in length")
    if len(set(image_ids)) != len(image_ids):
        raise DataFormatError(out_path, "several images share an image id; pass distinct image_ids")
    if num_workers is None:
        num_workers = default_num_workers()
    if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 1:
        raise ConfigError(f"num_workers must be a positive integer, got {num_workers!r}")
    if not isinstance(num_proposals, (int, np.integer)) or num_proposals < 1:
        raise ConfigError(f"num_proposals must be a positive integer, got {num_proposals!r}")

    num_workers = int(min(num_workers, len(image_paths) // _MIN_IMAGES_PER_WORKER))
    if num_workers <= 1:
        outcomes = [_proposals_for_paths((image_paths, int(num_proposals), int(seed)))]
    else:
        chunk_size = -(-len(image_paths) // (num_workers * _CHUNKS_PER_WORKER))
        tasks = [(image_paths[start:start + chunk_size], int(num_proposals), int(seed))
                 for start in range(0, len(image_paths), chunk_size)]
        outcomes = []
        if spawn_pool_is_safe():
            pool = multiprocessing.get_context("spawn").Pool(num_workers)
            results, close = pool.imap(_proposals_for_paths, tasks), pool.terminate
        else:
            # numpy, scipy and PIL release the GIL for most of a proposal's work.
            executor = concurrent.futures.ThreadPoolExecutor(num_workers)
            results = executor.map(_proposals_for_paths, tasks)
            close = functools.partial(executor.shutdown, wait=True, cancel_futures=True)
        try:
            for outcome in results:
                outcomes.append(outcome)
                if outcome[0] == "error":
                    break
        finally:
            close()
    boxes_in_order: list[np.ndarray] = []
    for outcome in outcomes:
        if outcome[0] == "error":
            raise DataFormatError(outcome[1], outcome[2])
        boxes_in_order.extend(outcome[1])
    proposals = dict(zip(image_ids, boxes_in_order))
    scores = {image_id: np.linspace(1.0, 0.0, num_proposals, endpoint=False, dtype=np.float32)
              for image_id in image_ids}
    write_proposals(out_path, proposals, scores)
    return proposals
