"""Titles of figures that say what ran, not only what the row is called after the paper."""
from __future__ import annotations

import re

BACKBONE_NAMES = {"resnet50": "ResNet-50", "resnet152": "ResNet-152", "vgg19": "VGG-19", "vgg16": "VGG-16"}
_BACKBONE_IN_NAME = re.compile(r"\((ResNet-50|ResNet-152|VGG-19|VGG-16)\)")
_STAGE_IN_NAME = re.compile(r"\bStage (II|I|1|2)\b")


def dual_path_stage_title(row_name: str, stage: int, image_backbone: str, image_weights: str | None) -> str:
    """The title of a dual-path stage's figures (the similarity histogram), e.g.
    "Ours (scene-CNN stand-in for ResNet-50) Stage II" for the row "Ours (ResNet-50) Stage II"
    evaluated after Stage 2 with the embedded data's scene CNN.

    The stage that ran replaces the one the row names ("Full model (Stage II)" after Stage 1 is
    "Full model (Stage I)"; never "Full model (Stage II) - Stage 2"), or is appended when it names
    none; the image CNN that ran replaces the paper's backbone when they differ (the scene-CNN
    stand-in; a backbone without weights is said to be randomly initialised)."""
    roman = {1: "I", 2: "II"}.get(int(stage), str(stage))
    title, named = _STAGE_IN_NAME.subn(f"Stage {roman}", row_name)
    if not named:
        title = f"{title} - Stage {roman}"
    ran = None
    if image_backbone == "scene_cnn":
        ran = "scene-CNN stand-in"
    elif not image_weights:
        ran = f"randomly initialised {BACKBONE_NAMES.get(image_backbone, image_backbone)}"
    if ran is None:
        return title
    paper = _BACKBONE_IN_NAME.search(title)
    if paper:
        what = f"{ran} for {paper.group(1)}" if image_backbone == "scene_cnn" else ran
        return title[:paper.start()] + f"({what})" + title[paper.end():]
    return f"{title}; image CNN: {ran}"
