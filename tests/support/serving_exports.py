"""Tiny exports of every family, for the tests that serve them as TF Serving would
(tests/apps/test_serving_requests.py) and the tests that run docs/SERVING.md and the README's
serving section (tests/project/test_readme_sequences.py); and a tiny trained run of the main job's row
(tests/apps/test_export_run_tool.py, tests/systems/two_branch/test_export_two_branch_raw.py). `session_shared` builds
each once per test session for every pytest-xdist worker.

Each builder writes one export (with its warm-up file) and returns its directory. The
models are those of the family's own export tests (tests/systems/*/test_export*.py), at the same
tiny sizes; weights are random: these tests are about the requests, not the scores.
"""
from __future__ import annotations

import io
import os
import pathlib

import keras
import numpy as np
from PIL import Image

FAMILIES = ("two_branch_embedding", "two_branch_similarity", "two_branch_raw", "two_branch_lstm",
            "region_phrase", "dual_path", "fragment", "npair")


def jpeg(seed: int, height: int = 40, width: int = 36) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def _two_branch(kind: str, folder: pathlib.Path) -> pathlib.Path:
    from tests.apps.test_export_retrieval import NUM_IMAGES, _model, _split
    from tf_twobranch.systems.two_branch.export import export_saved_model
    from tf_twobranch.run_export import gallery_from_model

    images, texts, caption_image = _split()
    model = _model(kind)
    gallery = gallery_from_model(model, {"image": images, "text": texts, "caption_image": caption_image},
                                 [f"img{i}" for i in range(NUM_IMAGES)], [f"cap{c}" for c in range(len(texts))])
    return export_saved_model(model, folder / "export", gallery=gallery)


def _two_branch_raw(folder: pathlib.Path) -> pathlib.Path:
    from tests.systems.two_branch.test_export import CAPTIONS, IMAGE_SIZE, _cfg
    from tf_twobranch.data.tokenize import tokenize_caption
    from tf_twobranch.systems.two_branch.export import export_saved_model
    from tf_twobranch.features.text_features import TfidfEncoder
    from tf_twobranch.systems.two_branch.model import build_model

    encoder = TfidfEncoder(max_features=20, stop_words=None).fit([tokenize_caption(c) for c in CAPTIONS])
    pixels = keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu")(keras.layers.Rescaling(1 / 255.0)(pixels))
    backbone = keras.Model(pixels, keras.layers.Dense(6)(keras.layers.GlobalAveragePooling2D()(x)))
    model = build_model(_cfg(text_dim=encoder.output_dim))
    return export_saved_model(model, folder / "export", text_encoder=encoder, image_backbone=backbone)


def _two_branch_lstm(folder: pathlib.Path) -> pathlib.Path:
    from tests.systems.two_branch.test_export import _cfg
    from tf_twobranch.systems.two_branch.export import export_saved_model
    from tf_twobranch.systems.two_branch.model import build_model

    model = build_model(_cfg(text_encoder="lstm", vocabulary=["<pad>", "<unk>", "a", "red", "seven"], max_len=4,
                             word_dim=3, lstm_units=4))
    return export_saved_model(model, folder / "export")


def _region_phrase(folder: pathlib.Path) -> pathlib.Path:
    from tests.systems.two_branch.test_export import CAPTIONS
    from tf_twobranch.data.tokenize import tokenize_caption
    from tf_twobranch.systems.two_branch.region_phrase_export import export_region_phrase_model
    from tf_twobranch.features.text_features import TfidfEncoder
    from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model

    encoder = TfidfEncoder(max_features=20, stop_words=None).fit([tokenize_caption(c) for c in CAPTIONS])
    pixels = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu")(keras.layers.Rescaling(1 / 255.0)(pixels))
    backbone = keras.Model(pixels, keras.layers.Dense(8)(keras.layers.GlobalAveragePooling2D()(x)))
    model = build_model(TwoBranchConfig(image_dim=8, text_dim=encoder.output_dim, image_hidden=(8,),
                                        text_hidden=(8,), embed_dim=4, dropout=0.0))
    return export_region_phrase_model(model, backbone, encoder, folder / "export", crop_size=16)


DUAL_PATH_WORDS = ["<pad>", "<unk>", "a", "red", "blue", "green", "seven", "three", "one", "two", "on", "the",
                   "dog", "runs", "grass"]


def _dual_path(folder: pathlib.Path) -> pathlib.Path:
    from tf_twobranch.systems.dual_path.export import export_dual_path
    from tf_twobranch.export.retrieval_signatures import RetrievalGallery
    from tf_twobranch.features.scene_cnn import build_scene_cnn, save_scene_cnn
    from tf_twobranch.systems.dual_path.model import DualPathConfig, build_dual_path_model

    _, extractor = build_scene_cnn(32, 10, feature_dim=16, widths=(4, 4, 8, 8))
    save_scene_cnn(extractor, folder / "scene_cnn.keras")
    model = build_dual_path_model(DualPathConfig(
        vocabulary_size=len(DUAL_PATH_WORDS), num_classes=4, image_size=32, text_width=4, text_blocks=(1, 1, 1, 1),
        max_len=12, word_dim=8, hidden_dim=16, embed_dim=8, image_backbone="scene_cnn",
        image_weights=str(folder / "scene_cnn.keras")))
    rng = np.random.default_rng(0)
    gallery = RetrievalGallery([f"img{i}" for i in range(3)], rng.normal(size=(3, 8)).astype(np.float32),
                               [f"cap{c}" for c in range(5)], rng.normal(size=(5, 8)).astype(np.float32))
    return export_dual_path(model, DUAL_PATH_WORDS, folder / "export", gallery=gallery)


# The fragment export's names: relations and words of the embedded data's parses, so that the
# README's and docs/SERVING.md's requests (words the embedded vocabulary knows) run on it as on a run
# of the README's commands.
FRAGMENT_RELATIONS = ["det", "amod", "prep", "pobj", "nsubj"]
FRAGMENT_WORDS = ["a", "red", "seven", "on", "grey", "background", "blue", "four", "the", "digit"]


def _fragment(folder: pathlib.Path) -> pathlib.Path:
    from tf_twobranch.systems.fragments.export import export_fragment_model
    from tf_twobranch.export.retrieval_signatures import RetrievalGallery
    from tf_twobranch.systems.fragments.features import fragment_cnn
    from tf_twobranch.features.scene_cnn import build_scene_cnn
    from tf_twobranch.systems.fragments.model import FragmentEmbeddingConfig, build_fragment_model

    _, extractor = build_scene_cnn(48, 10, feature_dim=8, widths=(4, 4, 8, 8))   # as the fragment tests'
    cnn = fragment_cnn(extractor, "scene_cnn", fine_tuned=False)
    config = FragmentEmbeddingConfig(image_dim=int(cnn.output_shape[-1]), num_relations=len(FRAGMENT_RELATIONS),
                                     vocabulary_size=len(FRAGMENT_WORDS), word_dim=4, embed_dim=6, smoothing=2.0)
    model = build_fragment_model(config, np.random.default_rng(1).normal(size=(len(FRAGMENT_WORDS), 4)))
    rng = np.random.default_rng(0)
    h = model.config.embed_dim
    image_mask = np.array([[True, True], [True, False], [True, True]])
    caption_mask = np.array([[True, True, False], [True, False, False], [True, True, True], [True, False, False]])
    gallery = RetrievalGallery([f"img{i}" for i in range(3)], rng.normal(size=(3, 2, h)).astype(np.float32),
                               [f"cap{c}" for c in range(4)], rng.normal(size=(4, 3, h)).astype(np.float32),
                               image_mask=image_mask, caption_mask=caption_mask)
    return export_fragment_model(model, folder / "export", relations=FRAGMENT_RELATIONS, words=FRAGMENT_WORDS,
                                 image_cnn=cnn, gallery=gallery)


def _npair(folder: pathlib.Path) -> pathlib.Path:
    from tests.apps.test_export_retrieval_fragment_npair import SIZE, VOCABULARY, _npair_model
    from tf_twobranch.data.tokenize import tokenize_caption
    from tf_twobranch.systems.npair.export import export_npair_model
    from tf_twobranch.run_export import gallery_from_model
    from tf_twobranch.systems.npair.features import encode_token_lists
    from tf_twobranch.systems.npair.model import NPairEvaluationSplit

    model = _npair_model("max_image", "vector")
    rng = np.random.default_rng(1)
    captions = ["a red dog", "the cat on a ball", "green park", "a dog runs"]
    tokens = encode_token_lists([tokenize_caption(c) for c in captions], VOCABULARY, 5)
    maps = model.backbone(rng.uniform(0, 255, (2, SIZE, SIZE, 3)).astype(np.float32), training=False).numpy()
    split = NPairEvaluationSplit(image=maps, text=tokens.token_ids, caption_image=np.array([0, 0, 1, 1]),
                                 token_mask=tokens.token_mask, vocabulary=VOCABULARY, max_words=5)
    gallery = gallery_from_model(model, split, ["img0", "img1"], [f"cap{c}" for c in range(len(captions))])
    return export_npair_model(model, folder / "export", vocabulary=VOCABULARY, gallery=gallery)


_BUILDERS = {
    "two_branch_embedding": lambda folder: _two_branch("embedding", folder),
    "two_branch_similarity": lambda folder: _two_branch("similarity", folder),
    "two_branch_raw": _two_branch_raw,
    "two_branch_lstm": _two_branch_lstm,
    "region_phrase": _region_phrase,
    "dual_path": _dual_path,
    "fragment": _fragment,
    "npair": _npair,
}


def build_export(family: str, folder) -> pathlib.Path:
    """Writes the tiny export of `family` (one of `FAMILIES`) to ``<folder>/export``."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return pathlib.Path(_BUILDERS[family](folder))


def session_shared(name: str, build, tmp_path_factory) -> pathlib.Path:
    """``build(folder)``'s result (a path inside `folder`), made once per test session and read by
    every test process.

    Under pytest-xdist each worker has its own base temp folder; their parent is the session's.
    The first process to ask builds under a file lock, the others wait for it and use the same
    files: what is shared is only read (tests that write copy it first).
    """
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "session_shared"
    root.mkdir(parents=True, exist_ok=True)
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "BUILT"
        if not done.exists():
            if folder.exists():           # a build interrupted by a crashed worker
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            path = pathlib.Path(build(folder))
            done.write_text(str(path.relative_to(folder)))
        return folder / done.read_text()


def shared_export(family: str, tmp_path_factory) -> pathlib.Path:
    """The tiny export of `family`, built once per test session (`session_shared`)."""
    return session_shared(f"export_{family}", lambda folder: build_export(family, folder), tmp_path_factory)


def tiny_b6_run(tmp_path_factory):
    """The main job's row b6 (scene CNN ten crops, Fisher HGLMM) trained for one epoch with its
    raw-input --export on a 50-image generated dataset; built once per test session (also for
    tests/systems/two_branch/test_export_two_branch_raw.py). Returns (dataset folder, run folder)."""
    def build(folder):
        from experiments import common
        from experiments import two_branch_retrieval as isr
        from tf_twobranch.data.embedded import generate_embedded_dataset
        dataset = generate_embedded_dataset(folder / "scenes", num_images=50, splits=(30, 5, 15),
                                            num_proposals=30)
        isr.run(common.parse_flagfile(
            isr.define_flags, str(common.resolve_config("two_branch_table2_b6_nonlinear_bidir_nbr_constraints")),
            [f"--dataset_dir={dataset}", "--hidden_dim=16", "--embed_dim=8", "--batch_size=20", "--epochs=1",
             "--top_k=3", "--scene_cnn_epochs=1", "--word_dim=6", "--verbose=0", f"--run_dir={folder / 'b6'}",
             "--export"]))
        return folder

    folder = session_shared("tiny_b6_run", build, tmp_path_factory)
    return folder / "scenes", folder / "b6"


# The run folders the README's and docs/SERVING.md's serving commands name (made by the README's
# experiment commands above them), and the tiny export of each one's family.
DOC_RUN_EXPORTS = {
    # The main job's export takes JPEG bytes and captions (and feature rows through *_features).
    "runs/two_branch_table2_b6_nonlinear_bidir_nbr_constraints/export": "two_branch_raw",
    "runs/two_branch_table1_b6_nonlinear_augm_pos_bidir_nbr_constraints/export": "region_phrase",
    "runs/dual_path_table2_full_model/export": "dual_path",
    "runs/fragments_table2_fragment_global_mil/export": "fragment",
    "runs/npair_table2_npair_word/export": "npair",
}


def make_doc_folder(folder, tmp_path_factory) -> pathlib.Path:
    """A working folder for the serving docs: ``runs/.../export`` of every family (tiny exports,
    copies of the session's `shared_export`s) and the images they name, ``dog.jpg`` (40x36) and
    ``street.jpg`` (48x64)."""
    import shutil

    folder = pathlib.Path(folder)
    # In the order opposite to tests/apps/test_serving_requests.py's, so that two workers building
    # the shared exports at the same time meet in the middle instead of waiting on each other.
    for run_export, family in reversed(DOC_RUN_EXPORTS.items()):
        built = shared_export(family, tmp_path_factory)
        (folder / run_export).parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(built, folder / run_export)
    (folder / "dog.jpg").write_bytes(jpeg(1))
    (folder / "street.jpg").write_bytes(jpeg(2, height=48, width=64))
    return folder
