"""The draw tools' figures: file names per tool, the heat-map picture (colour bar, wrapped titles,
the arg-max cross inside the image), the pictures count's wording."""
import numpy as np
import pytest

from tf_twobranch.evaluation.pointing_game import PointingQuery
from tf_twobranch.figures import TOOL_PREFIXES, figure_path, wrote_message
from tf_twobranch.systems.npair import heat_map_figures as heat_maps


def _query(phrase, boxes, size=96):
    return PointingQuery(image_id="1352291085", sentence_index=0, phrase_index=0, caption_words=phrase.split(),
                         word_span=(0, len(phrase.split())), phrase=phrase,
                         boxes=np.asarray(boxes, np.float32), image_width=size, image_height=size)


def test_every_draw_tool_names_its_files_after_itself(tmp_path):
    names = {tool: figure_path(tmp_path, tool, "12/34") for tool in TOOL_PREFIXES}
    assert len(set(names.values())) == len(TOOL_PREFIXES)          # one --out_dir, no overwriting
    assert names["two_branch_draw"].name == "region_phrase_12_34.png"
    assert names["fragments_draw"].name == "fragments_12_34.png"
    assert figure_path(tmp_path, "npair_draw", "7", "_s0_word").name == "heat_maps_7_s0_word.png"


def test_the_pictures_count_is_pluralised():
    assert wrote_message(["a"], "figures") == "Wrote 1 picture to figures"
    assert wrote_message(["a", "b"], "figures") == "Wrote 2 pictures to figures"
    assert wrote_message([], "figures") == "Wrote 0 pictures to figures"


def test_the_cross_is_drawn_inside_the_image_but_the_point_is_not_moved():
    arm = heat_maps.marker_arm(96, 96)
    assert arm == pytest.approx(5.76)
    assert heat_maps.marker_position(88, 0, 96, 96, arm) == (88, pytest.approx(-0.5 + arm))
    assert heat_maps.marker_position(95, 95, 96, 96, arm) == (pytest.approx(95.5 - arm),) * 2
    assert heat_maps.marker_position(40, 50, 96, 96, arm) == (40, 50)


@pytest.fixture
def drawn(tmp_path, monkeypatch):
    """Draws a picture whose maxima sit in edge cells; returns (path, the matplotlib figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    image = np.random.default_rng(0).integers(0, 255, (96, 96, 3)).astype(np.uint8)
    corner = np.zeros((6, 6)); corner[0, 5] = 1.0            # the top-right cell
    left = np.zeros((6, 6)); left[3, 0] = 2.0
    caption = ("a man in a bright red jacket with a very long caption that goes on and on "
               "standing beside a green bicycle near the old stone bridge over the river")
    queries = [_query("a man in a bright red jacket with a very long caption", [[60, 0, 95, 20]]),
               _query("a green bicycle", [[10, 40, 30, 70]])]
    path = heat_maps.draw_phrase_heat_maps(image, queries, [corner, left], tmp_path / "h.png", title=caption)
    return path, figures[-1]


def test_heat_maps_have_a_colour_bar_and_the_cross_lies_in_the_image(drawn):
    path, fig = drawn
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image_axes = [ax for ax in fig.axes if ax.get_images()]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(image_axes) == 3 and len(bars) == 2                 # one colour bar per heat map
    for ax in image_axes[1:]:
        crosses = [line for line in ax.get_lines() if line.get_gid() == "argmax_marker"]
        assert len(crosses) == 2
        for line in crosses:
            x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
            assert x.min() >= -0.5 and x.max() <= 95.5 and y.min() >= -0.5 and y.max() <= 95.5


def test_long_titles_are_wrapped_inside_the_figure(drawn):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    _, fig = drawn
    renderer = FigureCanvasAgg(fig).get_renderer()
    box = fig.bbox
    titles = [ax.title for ax in fig.axes if ax.get_images()]
    assert "\n" in titles[0].get_text() and "\n" in titles[1].get_text()
    for title in titles:
        extent = title.get_window_extent(renderer)
        assert extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1, title.get_text()


def test_the_dual_path_histogram_title_says_what_ran():
    from tf_twobranch.figures.titles import dual_path_stage_title

    # The embedded data's scene CNN ran, not the paper's ResNet-50.
    assert dual_path_stage_title("Ours (ResNet-50) Stage II", 2, "scene_cnn", "/c/scene_cnn.keras") == \
        "Ours (scene-CNN stand-in for ResNet-50) Stage II"
    assert dual_path_stage_title("Ours (ResNet-50) Stage II", 1, "scene_cnn", "x") == \
        "Ours (scene-CNN stand-in for ResNet-50) Stage I"
    # No doubled stage.
    assert dual_path_stage_title("Full model (Stage II)", 2, "resnet50", "/w/resnet50.h5") == "Full model (Stage II)"
    assert dual_path_stage_title("Full model (Stage II)", 1, "scene_cnn", "x") == \
        "Full model (Stage I); image CNN: scene-CNN stand-in"
    assert dual_path_stage_title("Position shift", 2, "resnet50", "w") == "Position shift - Stage II"
    assert dual_path_stage_title("Ours (VGG-19) Stage I, 1K", 1, "vgg19", None) == \
        "Ours (randomly initialised VGG-19) Stage I, 1K"
