"""Real-size synthetic dataset folders for `benchmarks.bench_scale`, in the formats the package reads.

Captions and their dependency parses are the real Flickr8K ones
(``../shared/realdata/flickr8k``), dealt out cyclically to synthetic image ids
``s000000, s000001, ...`` (five captions each) so a folder can have any number
of images; features are random of the papers' sizes, written block by block
(`row_arrays.RowWriter`) so that writing a 12 GB folder needs no 12 GB of RAM.
"""
from __future__ import annotations

import pathlib

import numpy as np

from tf_twobranch.data.formats import row_arrays

REALDATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "realdata"
FLICKR8K = REALDATA / "flickr8k"


def _flickr8k_images() -> tuple[list[str], dict[str, list[str]], dict[str, list[str]]]:
    """(image names in file order, name -> its 5 caption lines' text, name -> its 5 CoNLL-U blocks)."""
    if not FLICKR8K.is_dir():
        raise SystemExit(f"bench_scale needs the real captions in {FLICKR8K} (shared/realdata beside the repo)")
    captions: dict[str, list[str]] = {}
    for line in (FLICKR8K / "Flickr8k.token.txt").read_text(encoding="utf-8").splitlines():
        key, _, text = line.partition("\t")
        captions.setdefault(key.split("#")[0], []).append(text)
    parses: dict[str, list[str]] = {}
    for block in (FLICKR8K / "Flickr8k.token.conllu").read_text(encoding="utf-8").split("\n\n"):
        block = block.strip("\n")
        if not block:
            continue
        sent_id = block.split("\n", 1)[0].removeprefix("# sent_id = ")
        parses.setdefault(sent_id.split("#")[0], []).append(block.split("\n", 1)[1])
    names = [n for n in captions if len(captions[n]) == 5 and len(parses.get(n, ())) == 5]
    return names, captions, parses


def synthetic_ids(count: int, offset: int = 0) -> list[str]:
    return [f"s{i:06d}" for i in range(offset, offset + count)]


def write_caption_folder(folder: pathlib.Path, num_train: int, num_test: int, *, parses: bool = True) -> dict:
    """A Flickr8K-layout folder (token file, split lists, CoNLL-U parses) of synthetic image ids."""
    folder.mkdir(parents=True, exist_ok=True)
    names, captions, trees = _flickr8k_images()
    train, test = synthetic_ids(num_train), synthetic_ids(num_test, num_train)
    conllu = open(folder / "Flickr8k.token.conllu", "w", encoding="utf-8") if parses else None
    with open(folder / "Flickr8k.token.txt", "w", encoding="utf-8") as tokens:
        for n, image in enumerate(train + test):
            source = names[n % len(names)]
            for k in range(5):
                tokens.write(f"{image}.jpg#{k}\t{captions[source][k]}\n")
                if conllu:
                    conllu.write(f"# sent_id = {image}.jpg#{k}\n{trees[source][k]}\n\n")
    if conllu:
        conllu.close()
    (folder / "Flickr_8k.trainImages.txt").write_text("".join(f"{i}.jpg\n" for i in train))
    (folder / "Flickr_8k.devImages.txt").write_text("".join(f"{i}.jpg\n" for i in test))
    (folder / "Flickr_8k.testImages.txt").write_text("".join(f"{i}.jpg\n" for i in test))
    return {"train": train, "test": test, "captions": [captions[names[n % len(names)]] for n in range(len(train + test))]}


def write_random_rows(path: pathlib.Path, shape, dtype="float32", seed: int = 0, *, nonnegative=False,
                      scale: float = 1.0):
    """Random normal rows of `shape` × `scale`, written block by block (ReLU-like when `nonnegative`)."""
    rng = np.random.default_rng(seed)
    with row_arrays.RowWriter(path, shape, np.dtype(dtype)) as out:
        step = max(1, (64 << 20) // (int(np.prod(shape[1:])) * 4))
        for start in range(0, shape[0], step):
            stop = min(start + step, shape[0])
            block = rng.standard_normal((stop - start, *shape[1:]), dtype=np.float32) * np.float32(scale)
            out[start:stop] = np.maximum(block, 0) if nonnegative else block
    return path
