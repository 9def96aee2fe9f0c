r"""Heat-map pictures of an N-pair localization row (Das et al., Figs. 1, 3 and 5).

For each chosen evaluation image and one of its Flickr30K Entities sentences
(``--sentence``), one PNG: the image, then for every annotated phrase its
heat map (word mode: the mean of its words' maps; phrase mode: the map of one
token from the mean of its word vectors) over the image with its colour bar,
the maximum the pointing game reads (a cross, drawn wholly inside the image)
and the phrase's ground-truth boxes (green when the maximum falls inside one,
red otherwise): ``<out_dir>/heat_maps_<image id>_s<sentence>_<mode>.png``.

The row is rebuilt from its run folder alone (`tf_twobranch.runs.load_run`:
its results.json recipe, the cached backbone maps and the checkpoint)::

    python -m experiments.npair_draw --run_dir=runs/npair_table2_npair_word --out_dir=figures \
        --image_index=0,1,2 --parse_mode=phrase
"""
from __future__ import annotations

import pathlib

from absl import app, flags

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.errors import UserInputError
from tf_twobranch.figures import figure_path, wrote_message
from tf_twobranch.run_folders import require_run_task

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("run_dir", "", "Run folder of a finished model row of experiments.npair.", **d)
    flags.DEFINE_string("out_dir", "figures", "Where the PNGs go (heat_maps_<image id>_s<sentence>_<mode>.png).",
                       **d)
    flags.DEFINE_list("image_index", ["0"], "Indices of the evaluation images to draw.", **d)
    flags.DEFINE_integer("sentence", 0, "Which of the image's Entities sentences.", lower_bound=0, **d)
    flags.DEFINE_enum("parse_mode", "word", ["word", "phrase"], "Heat map of a phrase.", **d)


def draw(run_dir, out_dir, image_indices, sentence: int = 0, parse_mode: str = "word") -> list[pathlib.Path]:
    """Draws the pictures; returns the PNG paths."""
    run_dir = pathlib.Path(run_dir)
    require_run_task(run_dir, "npair", "experiments.npair_draw")
    if not (run_dir / "results.json").is_file():
        raise UserInputError(f"--run_dir={run_dir}: no results.json; expected the run folder of a finished "
                             "model row of python -m experiments.npair")
    # TensorFlow only now: --help stays fast.
    from tf_twobranch.data.formats.images import load_image
    from tf_twobranch.systems.npair import heat_maps as localization_maps
    from tf_twobranch.systems.npair.heat_map_figures import draw_phrase_heat_maps
    from tf_twobranch.systems.npair.pipeline import dataset_layout, recipe_of_run
    from tf_twobranch.runs import load_run

    run = load_run(run_dir)
    recipe = recipe_of_run(run)
    split = run.evaluation_split()
    _, layout = dataset_layout(recipe)
    if split.queries is None:
        raise UserInputError(f"{layout.root}: no Flickr30K Entities Sentences/ and Annotations/ to draw from")
    out = []
    for index in image_indices:
        if not 0 <= index < len(split.image_ids):
            raise UserInputError(f"--image_index={index}: the {recipe.eval_split} split has "
                                 f"{len(split.image_ids)} images")
        image_id = split.image_ids[index]
        queries = [q for q in split.queries if q.image_id == image_id and q.sentence_index == sentence]
        if not queries:
            raise UserInputError(f"image {image_id}, sentence {sentence}: no phrase with a ground-truth box")
        # Only the evaluation chunk holding the image is projected (the split's maps may not fit in
        # memory); it is the chunk the run's evaluation projected, so the maps are the run's.
        first = index // localization_maps.MAP_CHUNK * localization_maps.MAP_CHUNK
        image_maps = localization_maps.projected_maps(
            run.model, split.image[first:first + localization_maps.MAP_CHUNK])
        heat = localization_maps.query_heat_maps(run.model, {image_id: image_maps[index - first]}, queries,
                                                 split.vocabulary, mode=parse_mode, max_words=split.max_words)
        path = layout.image_paths([image_id])[0]
        out.append(draw_phrase_heat_maps(
            load_image(path), queries, heat,
            figure_path(out_dir, "npair_draw", image_id, f"_s{sentence}_{parse_mode}"),
            title=" ".join(queries[0].caption_words)))
    return out


def _main() -> None:
    if not FLAGS.run_dir:
        raise UserInputError("--run_dir is required (the run folder of a finished model row)")
    try:
        indices = [int(i) for i in FLAGS.image_index]
    except ValueError:
        raise UserInputError(f"--image_index takes integers, got {FLAGS.image_index}") from None
    paths = draw(FLAGS.run_dir, FLAGS.out_dir, indices, FLAGS.sentence, FLAGS.parse_mode)
    for path in paths:
        print(path)
    print(wrote_message(paths, FLAGS.out_dir))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
