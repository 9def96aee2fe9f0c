"""Caption tokenization, in Python and as TensorFlow graph ops (same tokens).

Token rule (both implementations):

1. Un-escape the HTML entities that occur in caption corpora: ``&amp;``,
   ``&lt;``, ``&gt;``, ``&quot;``, ``&apos;``, ``&#39;`` and ``&#x27;``
   (with the ``;``; other entities are left alone, so ``&eacute;`` yields the
   token ``eacute``).  Multi30K's Flickr30K captions contain ``&amp;``.  A
   single pass, as ``html.unescape``: ``&amp;lt;`` becomes ``&lt;``.
2. Map the typographic apostrophe U+2019 to ``'``.
3. Lower-case (Unicode full lower-casing: ``str.lower`` == ``tf.strings.lower``
   with ``encoding='utf-8'``).
4. A token is a maximal run of word characters -- Unicode letters, numbers
   and combining marks (categories L*, N*, M*) -- in which single
   apostrophes *between* word characters are kept: ``"man's"`` is one token,
   ``"boys'"`` gives ``boys``, ``"'s"`` gives ``s`` and ``"rock''n"`` gives
   ``rock``, ``n``.  Everything else (punctuation, ``_``, symbols, spaces)
   separates tokens.

`tokenize_caption` is the reference; `tf_tokenize` gives exactly the same
tokens inside a TF graph (tests compare them on real captions).  Character
classes come from Python's `unicodedata` and RE2's tables respectively; they
only disagree on code points assigned in different Unicode versions.
"""
from __future__ import annotations

import collections
import re
import unicodedata
from typing import Iterable

from tf_twobranch.errors import ConfigError

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
# Caption boundaries of the N-pair localization model's LSTM input (Das et al.; the authors' code).
START_TOKEN, END_TOKEN = "<start>", "<end>"

# Applied in this order; "&amp;" last gives html.unescape's single-pass result.
_ENTITIES = (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"),
             ("&#39;", "'"), ("&#x27;", "'"), ("&amp;", "&"))
_ENTITY_RE = re.compile("|".join(re.escape(e) for e, _ in _ENTITIES))
_ENTITY_MAP = dict(_ENTITIES)
_ASCII_TOKEN_RE = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")
_GENERIC_TOKEN_RE = re.compile(r"[^ ']+(?:'[^ ']+)*")


def _unescape(text: str) -> str:
    if "&" not in text:
        return text
    return _ENTITY_RE.sub(lambda m: _ENTITY_MAP[m.group(0)], text)


def _is_word_char(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "LNM"


def tokenize_caption(text: str) -> list[str]:
    """Lower-cased word tokens of a caption (see the module docstring for the rule)."""
    text = _unescape(text).replace("\u2019", "'").lower()
    if text.isascii():
        return _ASCII_TOKEN_RE.findall(text)
    # Non-ASCII: blank out every non-word character except the apostrophe,
    # then take apostrophe-joined runs.
    text = "".join(ch if ch == "'" or _is_word_char(ch) else " " for ch in text)
    return _GENERIC_TOKEN_RE.findall(text)


def tf_tokenize(strings):
    """Tokenizes a string tensor with graph ops; same tokens as `tokenize_caption`.

    Args:
      strings: tf.string tensor of any rank (typically a batch (B,)); a
        Python string or list is converted.
    Returns:
      tf.RaggedTensor of tf.string tokens with one more (ragged) dimension
      than `strings` (for a scalar string: a 1-D tf.string Tensor).
    """
    # TensorFlow only for the graph tokenizer: `tokenize_caption` and the data readers stay light.
    import tensorflow as tf
    import tensorflow_text as tf_text

    text = tf.convert_to_tensor(strings, dtype=tf.string)
    for entity, replacement in _ENTITIES:
        text = tf.strings.regex_replace(text, re.escape(entity), replacement)
    text = tf.strings.regex_replace(text, "\u2019", "'")
    text = tf.strings.lower(text, encoding="utf-8")
    # Keep word characters and apostrophes; then drop apostrophes that are
    # not between two word characters (runs of 2+, or at a token edge).
    text = tf.strings.regex_replace(text, r"[^\pL\pN\pM']+", " ")
    text = tf.strings.regex_replace(text, r"''+", " ")
    text = tf.strings.regex_replace(text, r"'( |$)", " ")
    text = tf.strings.regex_replace(text, r"(^| )'", " ")
    return tf_text.WhitespaceTokenizer().tokenize(text)


def build_vocabulary(token_lists: Iterable[Iterable[str]], min_count: int = 1,
                     max_size: int | None = None) -> list[str]:
    """Word list with "<pad>" at index 0 and "<unk>" at index 1.

    Words follow in order of decreasing count, ties alphabetically (so the
    result is deterministic).

    Args:
      token_lists: tokenized captions.
      min_count: keep words occurring at least this often.
      max_size: maximum length of the returned list, the two reserved
        entries included (None: unlimited).
    """
    if min_count < 1:
        raise ConfigError(f"min_count must be >= 1, got {min_count}")
    if max_size is not None and max_size < 2:
        raise ConfigError(f"max_size must be >= 2 (room for {PAD_TOKEN} and {UNK_TOKEN}), "
                          f"got {max_size}")
    counts = collections.Counter()
    for tokens in token_lists:
        counts.update(tokens)
    for reserved in (PAD_TOKEN, UNK_TOKEN):
        counts.pop(reserved, None)
    words = sorted((w for w, c in counts.items() if c >= min_count),
                   key=lambda w: (-counts[w], w))
    vocabulary = [PAD_TOKEN, UNK_TOKEN] + words
    if max_size is not None:
        vocabulary = vocabulary[:max_size]
    return vocabulary
