"""Linear-probe digit accuracy of the scene CNN's region features on the embedded data.

Run from the repository root:

    python -m benchmarks.probe_scene_cnn [--out_json benchmarks/results/probe_scene_cnn.json]
        [--save_backbone /tmp/scene_cnn.keras | --load_backbone /tmp/scene_cnn.keras]

Trains the scene CNN exactly as the image–sentence experiments do
(`tf_twobranch.features.prepare.train_scene_cnn_backbone` with the default
`FeatureSpec`), or loads one, then encodes every ground-truth object box of
the train and test scenes the way image fragments are encoded
(`extract_region_features` on the half-open box, warped to the CNN input),
labels each box with the digit class its phrases name
(`tf_twobranch.evaluation.linear_probe.digit_object_boxes`), fits a
logistic-regression probe on the *training* crops and prints its accuracy on
the *test* crops, the chance level (most frequent training class), the
counts and the backbone's training time.  The issue's acceptance line asks
for >= 90 % on this data.  Benchmarks print figures; they are not tests.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks import common

TARGET_ACCURACY = 0.90


def _box_features(layout, image_ids, boxes, backbone) -> tuple[np.ndarray, np.ndarray]:
    """Features of every labelled box of `image_ids`, in `boxes.by_image()` order, and their labels."""
    from tf_twobranch.features.image_features import extract_region_features

    paths = dict(zip(image_ids, layout.image_paths(image_ids)))
    features, labels = [], []
    for image_id, (image_boxes, image_labels) in boxes.by_image().items():
        # Inclusive boxes, made half-open as tf_twobranch.systems.fragments.image_fragments does.
        features.append(extract_region_features(paths[image_id], image_boxes + np.array([0, 0, 1, 1], np.float32),
                                                backbone, source=str(paths[image_id])))
        labels.append(image_labels)
    return np.concatenate(features), np.concatenate(labels)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_json", default=None, help="also write the report here")
    parser.add_argument("--scene_cnn_epochs", type=int, default=None,
                        help="FeatureSpec.scene_cnn_epochs (default: the FeatureSpec default)")
    parser.add_argument("--load_backbone", default=None,
                        help="probe this saved scene_cnn (.keras) instead of training one")
    parser.add_argument("--save_backbone", default=None, help="save the trained backbone here (.keras)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from tf_twobranch.data.embedded import load_embedded_dataset
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.data.phrases import build_phrase_examples
    from tf_twobranch.data.retrieval_data import load_caption_splits
    from tf_twobranch.evaluation.linear_probe import chance_accuracy, digit_object_boxes, linear_probe_accuracy
    from tf_twobranch.features.prepare import FeatureSpec, train_scene_cnn_backbone
    from tf_twobranch.features.scene_cnn import load_scene_cnn, save_scene_cnn

    report, lines, started = common.start_report()
    layout = resolve_dataset(load_embedded_dataset())
    splits = load_caption_splits(layout)
    spec = FeatureSpec(seed=args.seed)
    if args.scene_cnn_epochs is not None:
        spec.scene_cnn_epochs = args.scene_cnn_epochs
    spec.validate()
    if args.load_backbone:
        backbone, train_seconds = load_scene_cnn(args.load_backbone), None
        origin = f"loaded from {args.load_backbone}"
    else:
        start = time.time()
        backbone, _ = train_scene_cnn_backbone(spec, splits["train"], layout)
        train_seconds = time.time() - start
        origin = f"trained by train_scene_cnn_backbone({spec})"
        if args.save_backbone:
            save_scene_cnn(backbone, args.save_backbone)

    start = time.time()
    data = {}
    for split in ("train", "test"):
        image_ids = list(splits[split].image_ids)
        boxes = digit_object_boxes(build_phrase_examples(layout.entities_dir, image_ids))
        features, labels = _box_features(layout, image_ids, boxes, backbone)
        data[split] = dict(features=features, labels=labels, images=len(image_ids),
                           skipped_chains=boxes.skipped_chains)
    extract_seconds = time.time() - start
    start = time.time()
    accuracy = linear_probe_accuracy(data["train"]["features"], data["train"]["labels"],
                                     data["test"]["features"], data["test"]["labels"], seed=args.seed)
    probe_seconds = time.time() - start
    chance = chance_accuracy(data["train"]["labels"], data["test"]["labels"])

    report.update({
        "backbone": origin, "feature_dim": int(data["train"]["features"].shape[1]),
        "test_accuracy": accuracy, "chance_accuracy": chance, "target_accuracy": TARGET_ACCURACY,
        "meets_target": accuracy >= TARGET_ACCURACY,
        "backbone_train_seconds": train_seconds, "extract_seconds": extract_seconds,
        "probe_seconds": probe_seconds,
        **{f"{s}_{k}": v for s, d in data.items() for k, v in
           (("images", d["images"]), ("boxes", int(len(d["labels"]))), ("skipped_chains", d["skipped_chains"]),
            ("class_counts", np.bincount(d["labels"], minlength=10).tolist()))},
    })
    lines += [f"Scene CNN {origin}",
              (f"  backbone training {train_seconds:.0f} s" if train_seconds is not None else "  backbone loaded"),
              f"  box features ({report['feature_dim']}-d) extracted in {extract_seconds:.0f} s, "
              f"probe fitted in {probe_seconds:.0f} s",
              "",
              common.format_table(
                  ["split", "images", "labelled boxes", "skipped chains"],
                  [[s, d["images"], len(d["labels"]), d["skipped_chains"]] for s, d in data.items()]),
              "",
              f"Linear-probe digit accuracy on test GT crops: {100 * accuracy:.1f} % "
              f"(chance {100 * chance:.1f} %, target >= {100 * TARGET_ACCURACY:.0f} %: "
              f"{'met' if accuracy >= TARGET_ACCURACY else 'NOT met'})"]
    if args.out_json:
        common.finish_report(report, lines, started, args.out_json)
    else:
        print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
