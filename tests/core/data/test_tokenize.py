import numpy as np
import pytest

from tf_twobranch.data.tokenize import build_vocabulary, tf_tokenize, tokenize_caption
from tf_twobranch.errors import ConfigError

EDGE_CASES = [
    ("Two young, White males are outside.", ["two", "young", "white", "males", "are", "outside"]),
    ("A man's hat", ["a", "man's", "hat"]),
    ("the boys' toys", ["the", "boys", "toys"]),
    ("a dog 's ball", ["a", "dog", "s", "ball"]),
    ("rock''n roll 'quoted'", ["rock", "n", "roll", "quoted"]),
    ("it\u2019s", ["it's"]),
    ("Bread &amp; butter", ["bread", "butter"]),
    ("&amp;lt; &quot;hi&quot; don&#39;t &amp", ["lt", "hi", "don't", "amp"]),
    ("x_y 3.5 6-year-old", ["x", "y", "3", "5", "6", "year", "old"]),
    ("Café naïve cafe\u0301 ΣΟΦΟΣ", ["café", "naïve", "cafe\u0301", "σοφος"]),
    ("日本語 テキスト", ["日本語", "テキスト"]),
    ("emoji \U0001F642 ok!", ["emoji", "ok"]),
    ("", []),
    ("  \t\n ", []),
    ("'''", []),
]


@pytest.mark.parametrize("text, tokens", EDGE_CASES)
def test_tokenize_caption_edge_cases(text, tokens):
    assert tokenize_caption(text) == tokens


def _tf_tokens(texts):
    return [[t.decode("utf-8") for t in row] for row in tf_tokenize(texts).to_list()]


def _random_strings(n, seed=0):
    rng = np.random.default_rng(seed)
    alphabet = list("aZ9 '\u2019-.,&;#_é\u0301ΣΟ日\t") + ["&amp;", "&lt;", "&#39;", "&quot;", "''"]
    return ["".join(rng.choice(alphabet, size=rng.integers(0, 15))) for _ in range(n)]


def test_tf_tokenize_matches_python_on_edge_cases_and_random_strings():
    texts = [t for t, _ in EDGE_CASES] + _random_strings(500)
    assert _tf_tokens(texts) == [tokenize_caption(t) for t in texts]


def test_tf_tokenize_inside_tf_function_keeps_batch_shape():
    import tensorflow as tf

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def tokenize(batch):
        return tf_tokenize(batch)

    result = tokenize(tf.constant(["A man's hat.", "", "Dogs &amp; cats"]))
    assert result.shape[0] == 3
    assert [[t.decode() for t in r] for r in result.to_list()] == [["a", "man's", "hat"], [], ["dogs", "cats"]]


def test_tf_tokenize_matches_python_on_real_captions(realdata):
    from tf_twobranch.data.formats.flickr30k_tokens import read_token_file

    captions = read_token_file(realdata / "flickr30k" / "captions_multi30k.token").captions
    with_entities = [c for c in captions if "&amp;" in c]
    assert len(with_entities) == 88
    texts = captions[:2000] + with_entities
    assert _tf_tokens(texts) == [tokenize_caption(t) for t in texts]
    assert all("amp" not in tokenize_caption(c) for c in with_entities)


def test_build_vocabulary_order_and_limits():
    lists = [["b", "a", "c"], ["a", "b"], ["a", "d"]]
    assert build_vocabulary(lists) == ["<pad>", "<unk>", "a", "b", "c", "d"]
    assert build_vocabulary(lists, min_count=2) == ["<pad>", "<unk>", "a", "b"]
    assert build_vocabulary(lists, max_size=3) == ["<pad>", "<unk>", "a"]
    assert build_vocabulary([["<unk>", "x"]]) == ["<pad>", "<unk>", "x"]
    with pytest.raises(ConfigError):
        build_vocabulary(lists, min_count=0)
    with pytest.raises(ConfigError):
        build_vocabulary(lists, max_size=1)


def test_caption_tokenizer_config_round_trip():
    import tensorflow as tf

    from tf_twobranch.systems.two_branch.text_towers import CaptionTokenizer

    layer = CaptionTokenizer(["<pad>", "<unk>", "dog"], 4)
    clone = CaptionTokenizer.from_config(layer.get_config())
    assert clone(tf.constant(["a dog"])).numpy().tolist() == [[1, 2, 0, 0]]
