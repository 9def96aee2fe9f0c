"""Caption parses from spaCy, the optional in-process parser of the fragment
experiment (``pip install -e ".[parse]"``).

spaCy is imported only by `load_spacy_model`, so the package works without
it; no spaCy *model* is ever a requirement or downloaded here: the user
installs one (``python -m spacy download en_core_web_sm``) or passes the
folder of a saved pipeline.

`parse_captions` turns captions into `DependencyTree`s exactly as
`read_conllu` reads the spaCy 3.8 ``en_core_web_sm`` parses of Flickr8K
(``Flickr8k.token.conllu``): one tree per caption, even when spaCy splits it
into two sentences (then it has two roots, heads counted over the whole
caption), spaCy's ``ROOT`` written ``root``, the other labels as spaCy gives
them (ClearNLP style: ``nsubj``, ``prep``, ``pobj``, ...), whitespace tokens
dropped, ``# sent_id = <image>.jpg#<k>`` and ``# text = <caption>``.
`write_caption_parses` stores them as CoNLL-U, so a caption file is parsed
once and then read like any other parser's output. The lemmatizer is not
run (fragments use word forms), so the LEMMA column repeats the word, and
UPOS/XPOS are ``_``, the CoNLL-U writer's columns.
"""
from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from tf_twobranch.data.formats.conllu import DependencyTree, caption_key, write_conllu
from tf_twobranch.data.formats.row_arrays import temp_beside
from tf_twobranch.errors import ConfigError, UserInputError

if TYPE_CHECKING:  # spaCy is optional: annotations only.
    from spacy.language import Language
    from spacy.tokens import Doc

__all__ = ["INSTALL_SPACY", "DOWNLOAD_MODEL", "load_spacy_model", "doc_to_trees", "parse_captions",
           "write_caption_parses"]

INSTALL_SPACY = 'pip install -e ".[parse]"'
DOWNLOAD_MODEL = "python -m spacy download en_core_web_sm"

# Components that assign nothing a dependency tree needs: excluded, so that they
# are neither loaded nor run on every caption.
UNNEEDED_PIPES = ("ner", "entity_ruler", "entity_linker", "lemmatizer", "textcat",
                  "textcat_multilabel", "spancat", "span_finder")

# Flickr token files and the real spaCy parses name captions <image>.jpg#<k>.
_IMAGE_EXTENSION = ".jpg"


def _import_spacy():
    try:
        import spacy
    except ImportError as err:
        raise ConfigError(f"parsing captions with spaCy needs spaCy, which is not installed ({err}); "
                          f"install it with `{INSTALL_SPACY}` (and a model, e.g. `{DOWNLOAD_MODEL}`), "
                          f"or pass parses made by another parser as a CoNLL-U file") from None
    return spacy


def _assigns_dependencies(nlp: Language) -> bool:
    for name in nlp.pipe_names:
        if any(attr in ("token.dep", "token.head") for attr in nlp.get_pipe_meta(name).assigns):
            return True
    return False


def load_spacy_model(name_or_path: str | os.PathLike) -> Language:
    """The spaCy pipeline `name_or_path` (an installed package name or a saved
    pipeline's folder), without the components parsing does not need.

    Never downloads anything. Raises ConfigError saying what to install when
    spaCy is missing, when no model of that name is installed (or the folder
    is not a spaCy pipeline), and when the pipeline has no dependency parser.
    """
    spacy = _import_spacy()
    name = os.fspath(name_or_path)
    is_folder = os.path.isdir(name)
    try:
        nlp = spacy.load(name, exclude=list(UNNEEDED_PIPES))
    except OSError as err:
        if is_folder:
            raise ConfigError(f"spaCy model {name!r} is a folder but not a saved spaCy pipeline "
                              f"(expected config.cfg and meta.json, as `nlp.to_disk` writes): "
                              f"{err}") from None
        installed = sorted(spacy.util.get_installed_models())
        raise ConfigError(f"spaCy model {name!r} is neither an installed spaCy model nor a folder; "
                          f"installed models: {', '.join(installed) or 'none'}. Install one with "
                          f"`{DOWNLOAD_MODEL}` (models are never downloaded at run time) or pass the "
                          f"folder of a saved pipeline") from None
    except (ValueError, ImportError) as err:   # bad config, unknown component, version clash
        raise ConfigError(f"spaCy model {name!r} could not be loaded by spaCy "
                          f"{spacy.__version__}: {err}") from None
    if not _assigns_dependencies(nlp):
        raise ConfigError(f"spaCy model {name!r} has no dependency parser (its components: "
                          f"{', '.join(nlp.pipe_names) or 'none'}); use a pipeline with a 'parser', "
                          f"e.g. en_core_web_sm (`{DOWNLOAD_MODEL}`)")
    return nlp


def _is_whitespace(token) -> bool:
    # spaCy makes extra spaces and newlines tokens of their own, not words.
    # `is_space` comes from the vocabulary's lexical attributes, which a bare
    # `Vocab()` lacks; the text test catches those tokens too.
    return token.is_space or not token.text.strip()


def doc_to_trees(doc: Doc, sent_id: str, text: str | None = None) -> DependencyTree:
    """The tree of one parsed caption (every sentence spaCy found in it).

    Whitespace tokens are dropped and heads renumbered over the remaining
    words; a word that hangs from a whitespace token takes that token's head
    (a root if there is none). `text` (default: the Doc's text) is written as
    ``# text``, with whitespace runs collapsed so that it stays one line.
    Raises UserInputError when the Doc has no dependency parse or no word.
    """
    if not doc.has_annotation("DEP"):
        raise UserInputError(f"caption {sent_id!r} has no dependency parse: it was processed by a "
                             f"spaCy pipeline without a 'parser' component (use e.g. en_core_web_sm)")
    kept = [token for token in doc if not _is_whitespace(token)]
    if not kept:
        raise UserInputError(f"caption {sent_id!r} has no word ({doc.text!r}); every caption must "
                             f"have at least one")
    position = {token.i: n for n, token in enumerate(kept, start=1)}
    words, heads, relations, lemmas = [], [], [], []
    for token in kept:
        head = token.head
        while head.i != token.i and head.i not in position and head.head.i != head.i:
            head = head.head   # climb over whitespace governors
        is_root = head.i == token.i or head.i not in position
        words.append(token.text)
        lemmas.append(token.lemma_ or token.text)
        heads.append(0 if is_root else position[head.i])
        relations.append("root" if is_root else (token.dep_ or "dep"))
    text = doc.text if text is None else text
    return DependencyTree(sent_id, tuple(words), tuple(heads), tuple(relations), tuple(lemmas),
                          " ".join(text.split()))


def _sent_id(key: str) -> str:
    """``<image>#<k>`` -> ``<image>.jpg#<k>`` (the Flickr token-file id), when `caption_key` maps it back."""
    image, sep, number = key.rpartition("#")
    sent_id = f"{image}{_IMAGE_EXTENSION}#{number}"
    return sent_id if sep and caption_key(sent_id) == key else key


def parse_captions(nlp: Language, captions: Sequence[str], keys: Sequence[str], *,
                   batch_size: int = 256) -> dict[str, DependencyTree]:
    """Parses `captions` with `nlp` (`load_spacy_model`); the tree of
    ``captions[i]`` is under ``keys[i]`` (``<image id>#<k>``, as
    `caption_keys` gives them), in caption order, as `read_conllu` keys them.

    Raises UserInputError when `keys` and `captions` differ in length, a key
    repeats, or a caption has no word.
    """
    captions, keys = list(captions), list(keys)
    if len(captions) != len(keys):
        raise UserInputError(f"{len(captions)} captions but {len(keys)} keys; expected one key "
                             f"(<image id>#<k>) per caption")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in seen:
            raise UserInputError(f"caption key {key!r} repeated (captions {seen[key]} and {i}); "
                                 f"every caption needs its own key")
        seen[key] = i
    trees = {}
    for key, caption, doc in zip(keys, captions, nlp.pipe(captions, batch_size=batch_size)):
        trees[key] = doc_to_trees(doc, _sent_id(key), caption)
    return trees


def write_caption_parses(path: str | os.PathLike,
                         trees: Iterable[DependencyTree] | Mapping[str, DependencyTree]) -> pathlib.Path:
    """Writes `trees` as CoNLL-U (`write_conllu`), readable by `read_conllu`.

    The file appears complete or not at all (written beside it, then
    renamed), so an interrupted parse never leaves a file that reads as a
    shorter parse. Parent folders are created.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
    try:
        write_conllu(tmp, trees)
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
