"""Tests for the pointing game (Das et al. §4.2, Table 2): hand-made maps, boxes and Entities folders."""
import pathlib

import numpy as np
import pytest

from tf_twobranch.data.formats import flickr30k_entities as fe
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.evaluation import pointing_game as pg

EMBEDDED_ROOT = pathlib.Path(__file__).resolve().parents[3] / "data" / "generated" / "digit_scenes"


def _query(width, height, boxes, *, image_id="1", sentence_index=0, phrase_index=0, types=("other",)):
    return pg.PointingQuery(image_id=image_id, sentence_index=sentence_index, phrase_index=phrase_index,
                            caption_words=["a", "thing"], word_span=(0, 2), phrase="a thing",
                            boxes=np.asarray(boxes, np.float32).reshape(-1, 4), image_width=width,
                            image_height=height, chain_id="1", phrase_types=list(types))


def _one_hot(height, width, x, y):
    heat_map = np.zeros((height, width))
    heat_map[y, x] = 1.0
    return heat_map


# --------------------------------------------------------------- hit test and maximum


def test_maximum_on_box_edge_hits_one_pixel_outside_misses():
    box = [[10, 5, 20, 15]]
    # A map the size of the image is not resampled, so the maximum stays on its pixel.
    on_edge = pg.heat_map_maximum(_one_hot(30, 40, 20, 15), 30, 40)
    assert on_edge == (20, 15)
    assert pg.point_hits_boxes(*on_edge, box)
    outside = pg.heat_map_maximum(_one_hot(30, 40, 21, 15), 30, 40)
    assert outside == (21, 15)
    assert not pg.point_hits_boxes(*outside, box)
    assert pg.point_hits_boxes(10, 5, box)             # top-left corner is inside
    for x, y in [(9, 5), (10, 4), (20, 16)]:
        assert not pg.point_hits_boxes(x, y, box)


def test_hit_in_second_of_several_boxes():
    boxes = [[0, 0, 5, 5], [30, 30, 40, 40]]
    assert pg.point_hits_boxes(35, 32, boxes)
    assert not pg.point_hits_boxes(20, 20, boxes)


def test_x_is_the_column_on_a_wide_image():
    # 120 wide, 40 high; the box covers the right end.  The map peaks in its
    # right column, so the point is (105, 0): a hit.  A swapped test (row 0
    # against x1..x2 = 100..119) would call it a miss.
    query = _query(120, 40, [[100, 0, 119, 39]])
    point = pg.heat_map_maximum(np.array([[0.0, 0.0, 0.0, 1.0]]), 40, 120, "argmax")
    assert point == (105, 0)            # first pixel whose source column reaches cell 3: (105.5)·4/120 − 0.5 = 3
    assert pg.heat_map_maximum(np.array([[0.0, 0.0, 0.0, 1.0]]), 40, 120) == (105, 20)   # the cell's centre
    assert pg.point_hits_boxes(*point, query.boxes)
    assert not pg.point_hits_boxes(point[1], point[0], query.boxes)
    assert pg.pointing_game_counts([point], [query]) == (1, 0)
    # A (row, column) pair given by mistake lies below this image: refused, not silently missed.
    with pytest.raises(UserInputError, match="outside the 120x40 image"):
        pg.pointing_game_counts([(point[1] + 2, 110)], [query])


def test_ties_go_to_first_pixel_in_row_major_order():
    heat_map = np.array([[0.0, 2.0, 0.0], [2.0, 0.0, 2.0]])
    for rule in pg.POINT_RULES:
        assert pg.heat_map_maximum(heat_map, 2, 3, rule) == (1, 0)


def test_edge_cell_points_at_its_centre_not_the_image_edge():
    # Issue 39: a 6 × 6 map on a 96-px image. The upsampled map of an edge cell is a clamped
    # plateau (the edge half-cell holds the cell's value), whose first pixel (LocNet's argmax)
    # is the image's edge; the default rule points at the arg-max cell's centre.
    top_right, left_row3 = np.zeros((6, 6)), np.zeros((6, 6))
    top_right[0, 5] = left_row3[3, 0] = 1.0
    assert pg.heat_map_maximum(top_right, 96, 96, "argmax") == (88, 0)
    assert pg.heat_map_maximum(left_row3, 96, 96, "argmax") == (0, 55)
    assert pg.DEFAULT_POINT_RULE == "cell_centre"
    assert pg.heat_map_maximum(top_right, 96, 96) == (88, 8)
    assert pg.heat_map_maximum(left_row3, 96, 96) == (8, 56)
    # A digit box inside the cell that does not touch the edge: hit by the centre only.
    box = [[82, 3, 93, 14]]
    assert pg.point_hits_boxes(*pg.heat_map_maximum(top_right, 96, 96), box)
    assert not pg.point_hits_boxes(*pg.heat_map_maximum(top_right, 96, 96, "argmax"), box)
    # An inner cell: both rules point into that cell (the bilinear map peaks at its centre).
    inner = np.zeros((6, 6))
    inner[2, 3] = 1.0
    for rule in pg.POINT_RULES:
        x, y = pg.heat_map_maximum(inner, 96, 96, rule)
        assert 48 <= x < 64 and 32 <= y < 48
    # Every cell's centre lies inside the image, for any sizes.
    for h, w, H, W in [(6, 6, 96, 96), (7, 5, 13, 11), (14, 14, 333, 500), (3, 4, 3, 4)]:
        for r in range(h):
            for c in range(w):
                one = np.zeros((h, w))
                one[r, c] = 1
                x, y = pg.heat_map_maximum(one, H, W)
                assert c * W / w <= x < (c + 1) * W / w and r * H / h <= y < (r + 1) * H / h
    with pytest.raises(ConfigError, match="point rule"):
        pg.heat_map_maximum(inner, 96, 96, "centre")


# --------------------------------------------------------------- upsampling


def test_upsample_half_pixel_centres_by_hand():
    # Output pixel i sits at source (i + 0.5)·in/out − 0.5 = −0.25, 0.25, 0.75, 1.25 → clamped.
    np.testing.assert_allclose(pg.upsample_heat_map([[0.0, 1.0]], 1, 4), [[0.0, 0.25, 0.75, 1.0]])
    np.testing.assert_allclose(pg.upsample_heat_map([[0.0], [4.0]], 4, 1), [[0.0], [1.0], [3.0], [4.0]])
    # Bilinear in both directions: the centre of a 2×2 map upsampled to 4×4.
    upsampled = pg.upsample_heat_map([[0.0, 4.0], [8.0, 12.0]], 4, 4)
    assert upsampled[1, 1] == pytest.approx(0.75 * 0.75 * 0 + 0.75 * 0.25 * 4 + 0.25 * 0.75 * 8 + 0.25 * 0.25 * 12)
    assert upsampled[0, 0] == 0.0 and upsampled[3, 3] == 12.0


def test_upsample_one_by_one_map_is_constant():
    upsampled = pg.upsample_heat_map([[3.5]], 5, 7)
    assert upsampled.shape == (5, 7)
    np.testing.assert_array_equal(upsampled, np.full((5, 7), 3.5))
    assert pg.heat_map_maximum([[3.5]], 5, 7, "argmax") == (0, 0)
    assert pg.heat_map_maximum([[3.5]], 5, 7) == (3, 2)          # the one cell's centre


def test_small_map_maximum_lands_in_its_quadrant():
    # A 2×2 map on a 90 (wide) × 60 (high) image, peak in the top-right cell.
    x, y = pg.heat_map_maximum([[0.0, 1.0], [0.0, 0.0]], 60, 90)
    assert x >= 45 and y < 30
    x, y = pg.heat_map_maximum([[0.0, 0.0], [1.0, 0.0]], 60, 90)
    assert x < 45 and y >= 30


def test_upsample_matches_tf_image_resize_bilinear():
    tf = pytest.importorskip("tensorflow")
    heat_map = np.random.default_rng(0).random((3, 2))
    expected = tf.image.resize(heat_map[:, :, None], (7, 5), method="bilinear").numpy()[:, :, 0]
    np.testing.assert_allclose(pg.upsample_heat_map(heat_map, 7, 5), expected, rtol=1e-5, atol=1e-6)


def test_bad_heat_maps_are_user_errors():
    with pytest.raises(UserInputError, match="2-D"):
        pg.upsample_heat_map(np.zeros((2, 2, 2)), 4, 4)
    with pytest.raises(UserInputError, match="NaN"):
        pg.heat_map_maximum([[0.0, np.nan]], 4, 4)
    with pytest.raises(UserInputError, match="positive"):
        pg.upsample_heat_map([[1.0]], 0, 4)


# --------------------------------------------------------------- counting


def test_per_box_and_phrase_counting_on_a_plural_phrase():
    plural = _query(40, 20, [[0, 0, 9, 9], [20, 0, 29, 9]])
    single = _query(40, 20, [[30, 10, 39, 19]])
    points = [(5, 5), (0, 0)]                          # plural: in its first box only; single: a miss
    assert pg.pointing_game_counts(points, [plural, single]) == (1, 1)
    assert pg.pointing_game_counts(points, [plural, single], counting="per_box") == (1, 2)
    overlapping = _query(40, 20, [[0, 0, 9, 9], [5, 5, 15, 15]])
    assert pg.pointing_game_counts([(7, 7)], [overlapping], counting="per_box") == (2, 0)
    assert pg.pointing_game_counts([(7, 7)], [overlapping]) == (1, 0)
    with pytest.raises(ConfigError, match="counting"):
        pg.pointing_game_counts(points, [plural, single], counting="boxes")
    with pytest.raises(UserInputError, match="2 queries"):
        pg.pointing_game_counts(points[:1], [plural, single])


def test_accuracy_and_zero_trials():
    assert pg.pointing_game_accuracy(1, 3) == 25.0
    with pytest.raises(UserInputError, match="no trials"):
        pg.pointing_game_accuracy(0, 0)
    with pytest.raises(UserInputError, match="no trials"):
        pg.evaluate_pointing_game([], [])


def test_evaluate_pools_trials_and_averages_captions():
    queries = [_query(40, 20, [[0, 0, 9, 9]], image_id="a", types=("people",)),
               _query(40, 20, [[0, 0, 9, 9]], image_id="b", types=("people", "other")),
               _query(40, 20, [[20, 0, 29, 9]], image_id="b", phrase_index=1, types=("other",))]
    result = pg.evaluate_pointing_game(queries, [(1, 1), (2, 2), (35, 15)])
    assert (result["hits"], result["misses"], result["trials"]) == (2, 1, 3)
    assert result["accuracy"] == pytest.approx(200 / 3)
    assert result["caption_mean_accuracy"] == pytest.approx((100 + 50) / 2)   # caption a: 1/1, caption b: 1/2
    assert result["accuracy_per_type"] == pytest.approx({"other": 50.0, "people": 100.0})
    assert result["trials_per_type"] == {"other": 2, "people": 2}


# --------------------------------------------------------------- baselines and model maps


def test_random_baseline_is_seeded_and_inside_the_image():
    queries = [_query(3, 2, [[0, 0, 0, 0]]) for _ in range(200)]
    first = pg.random_points(queries, seed=7)
    assert first == pg.random_points(queries, seed=7)
    assert first != pg.random_points(queries, seed=8)
    assert all(0 <= x <= 2 and 0 <= y <= 1 for x, y in first)
    assert len(set(first)) == 6                        # every pixel, the last row and column included


def test_centre_baseline_odd_and_even_sizes():
    queries = [_query(5, 7, [[0, 0, 1, 1]]), _query(4, 6, [[0, 0, 1, 1]]), _query(1, 1, [[0, 0, 0, 0]])]
    assert pg.centre_points(queries) == [(2, 3), (1, 2), (0, 0)]


def test_phrase_heat_map_is_mean_of_its_word_maps():
    word_maps = np.arange(4 * 2 * 2, dtype=np.float64).reshape(4, 2, 2)
    np.testing.assert_allclose(pg.phrase_heat_map(word_maps, (1, 3)), [[6.0, 7.0], [8.0, 9.0]])
    with pytest.raises(UserInputError, match="word span"):
        pg.phrase_heat_map(word_maps, (3, 5))
    with pytest.raises(UserInputError, match="word span"):
        pg.phrase_heat_map(word_maps, (2, 2))


def test_points_from_heat_maps_uses_the_phrase_words():
    # Word 0 peaks on the left, words 1-2 on the right; the phrase is words 1..2.
    word_maps = np.array([[[1.0, 0.0]], [[0.0, 1.0]], [[0.2, 0.8]]])
    query = _query(120, 40, [[80, 0, 119, 39]])
    query.word_span = (1, 3)
    points = pg.points_from_heat_maps([query], lambda q: pg.phrase_heat_map(word_maps, q.word_span))
    assert points == [(90, 20)]         # the phrase map [[0.1, 0.9]]: its right cell's centre
    # LocNet's rule: the first pixel of the upsampled map's plateau, column 90 of row 0.
    assert pg.points_from_heat_maps([query], lambda q: pg.phrase_heat_map(word_maps, q.word_span),
                                    rule="argmax") == [(90, 0)]
    assert pg.evaluate_pointing_game([query], points)["accuracy"] == 100.0


# --------------------------------------------------------------- queries from Flickr30K Entities


def _write_entities(root):
    (root / "Sentences").mkdir()
    (root / "Annotations").mkdir()
    sentences = [fe.parse_sentence_line(line) for line in (
        "[/EN#1/people Two Young guys] look at [/EN#2/animals a dog] in [/EN#8/scene the yard] .",
        "[/EN#0/notvisual Someone] sees [/EN#3/other/clothing A red hat] .")]
    fe.write_sentence_file(root / "Sentences" / "42.txt", sentences)
    annotation = fe.ImageAnnotation(
        width=120, height=80, depth=3,
        boxes={"1": np.array([[0, 0, 19, 39], [60, 10, 79, 79]], np.float32),
               "2": np.array([[30, 50, 49, 69]], np.float32),
               "3": np.array([[100, 0, 119, 9]], np.float32)},
        scene_chains=["8"], nobox_chains=[])
    fe.write_annotation_file(root / "Annotations" / "42.xml", annotation, "42.jpg")
    return root


def test_pointing_queries_from_an_entities_folder(tmp_path):
    queries = pg.pointing_queries(_write_entities(tmp_path), ["42"])
    got = [(q.sentence_index, q.phrase_index, q.phrase, q.word_span) for q in queries]
    # "Someone" (not visual) and "the yard" (scene chain, no box) are left out.
    assert got == [(0, 0, "Two Young guys", (0, 3)), (0, 1, "a dog", (5, 7)), (1, 1, "A red hat", (2, 5))]
    first, _, hat = queries
    assert first.caption_words == ["two", "young", "guys", "look", "at", "a", "dog", "in", "the", "yard", "."]
    assert hat.caption_words[2:5] == ["a", "red", "hat"]
    np.testing.assert_array_equal(first.boxes, [[0, 0, 19, 39], [60, 10, 79, 79]])
    assert (first.image_width, first.image_height, first.image_id) == (120, 80, "42")
    assert hat.phrase_types == ["other", "clothing"] and hat.chain_id == "3"
    # The plural chain: its point in the second box is a hit for the phrase, one of two per box.
    points = [(70, 20), (40, 60), (0, 0)]
    assert pg.pointing_game_counts(points, queries) == (2, 1)
    assert pg.pointing_game_counts(points, queries, counting="per_box") == (2, 2)


@pytest.mark.skipif(not (EMBEDDED_ROOT / "test.txt").is_file(), reason="embedded dataset not generated")
def test_pointing_queries_on_embedded_test_images():
    image_ids = [line.strip() for line in (EMBEDDED_ROOT / "test.txt").read_text().splitlines() if line.strip()][:3]
    queries = pg.pointing_queries(EMBEDDED_ROOT, image_ids)
    assert queries and {q.image_id for q in queries} <= set(image_ids)
    for q in queries:
        assert q.boxes.ndim == 2 and len(q.boxes) >= 1
        assert (q.boxes[:, 0] >= 0).all() and (q.boxes[:, 1] >= 0).all()
        assert (q.boxes[:, 2] <= q.image_width - 1).all() and (q.boxes[:, 3] <= q.image_height - 1).all()
        start, stop = q.word_span
        assert q.caption_words[start:stop] == q.phrase.lower().split(" ")
    assert pg.evaluate_pointing_game(queries, pg.centre_points(queries))["trials"] == len(queries)
