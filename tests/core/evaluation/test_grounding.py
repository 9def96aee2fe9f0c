"""evaluation.grounding: one phrase set (fingerprint), one rule (the pointing game for every
localizer, box R@1 for box rankers), and the fragment model's grounding on a hand-made case."""
import numpy as np
import pytest

from tf_twobranch.data.formats import flickr30k_entities as fe
from tf_twobranch.data.phrases import collect_phrase_examples, phrase_fingerprint
from tf_twobranch.systems.fragments.sentence_fragments import Triplet, encode_fragments, tree_triplets
from tf_twobranch.data.formats.conllu import DependencyTree
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import grounding as gr
from tf_twobranch.evaluation import pointing_game as pg

WORDS = ["a", "red", "seven", "and", "a", "blue", "two"]
WHOLE, BOX_A, BOX_B = [0, 0, 99, 99], [10, 10, 29, 29], [60, 60, 89, 89]


def _query(span, boxes, *, index, image_id="img", sentence_index=0, words=WORDS):
    return pg.PointingQuery(image_id=image_id, sentence_index=sentence_index, phrase_index=index,
                            caption_words=list(words), word_span=span, phrase=" ".join(words[span[0]:span[1]]),
                            boxes=np.asarray(boxes, np.float32).reshape(-1, 4), image_width=100, image_height=100)


def _case(sentence_vectors, caption_words=WORDS):
    """One image (the whole image, box A, box B), one caption with three triplets:
    amod(seven, red), amod(two, blue), det(seven, a); three phrases: "a red seven" (its box
    near A), "a blue two" (near B) and "and" (no triplet touches it; its box is the whole image)."""
    queries = [_query((0, 3), [8, 8, 30, 30], index=0), _query((4, 7), [60, 60, 90, 90], index=1),
               _query((3, 4), WHOLE, index=2)]
    v = np.asarray([[[0.1, 0.1], [1.0, 0.0], [0.0, 1.0]]], np.float32)       # whole image, A, B
    return gr.fragment_grounding(
        queries, image_ids=["img"], caption_image=[0], caption_words=[caption_words], image_fragments=v,
        image_mask=np.ones((1, 3), bool), sentence_fragments=np.asarray(sentence_vectors, np.float32),
        row_splits=[0, 3], positions=[[2, 1], [6, 5], [2, 0]],
        image_boxes={"img": np.asarray([WHOLE, BOX_A, BOX_B], np.float32)})


def test_fragment_grounding_the_right_box_wins_and_a_phrase_without_triplet_is_a_counted_miss():
    result = _case([[1.0, 0.0], [0.0, 1.0], [0.5, 0.0]])
    assert result["rule"] == "best_fragment" and result["num_phrases"] == 3
    # "a red seven" -> box A, "a blue two" -> box B: two hits; "and" has no triplet: a miss,
    # although the whole image (its box) would have been a hit.
    assert result["pointing"]["hits"] == 2 and result["pointing"]["misses"] == 1
    assert result["pointing"]["queries_without_point"] == 1 and result["phrases_without_fragment"] == 1
    assert result["pointing_accuracy"] == pytest.approx(200 / 3)
    assert result["box_r1"] == pytest.approx(200 / 3) and result["box_upper_bound"] == 100.0
    assert result["phrases_without_parse"] == 0
    # The model's scores decide: with the two words' vectors swapped the boxes swap and both miss.
    swapped = _case([[0.0, 1.0], [1.0, 0.0], [0.0, 0.5]])
    assert swapped["pointing"]["hits"] == 0 and swapped["box_r1"] == 0.0
    # Same phrases, same fingerprint, whatever the scores.
    assert swapped["phrase_fingerprint"] == result["phrase_fingerprint"]


def test_a_caption_whose_parse_is_of_other_words_is_a_counted_miss():
    result = _case([[1.0, 0.0], [0.0, 1.0], [0.5, 0.0]], caption_words=["a", "green", "five"])
    assert result["phrases_without_parse"] == 3 and result["pointing"]["hits"] == 0
    assert result["pointing"]["trials"] == 3


def test_word_alignment_and_phrase_triplets():
    assert gr.align_words(["A", "man", "'s", "hat", "."], ["a", "man's", "hat", "."]).tolist() == [0, 1, 1, 2, 3]
    assert gr.align_words(["a", "hat"], ["a", "cat"]) is None
    # Governor or dependent inside the span [1, 3).
    positions = [[2, 1], [4, 3], [0, 2], [-1, -1]]
    assert gr.phrase_fragments(positions, np.arange(5), (1, 3)).tolist() == [0, 2]
    assert gr.phrase_fragments(positions, np.arange(5), (3, 4)).tolist() == [1]
    with pytest.raises(UserInputError, match="no sentence fragment"):
        gr.fragment_box_scores(np.ones((2, 2)), [True, True], np.zeros((0, 2)))


def test_triplets_carry_their_word_positions_through_encoding():
    tree = DependencyTree("x#0", ("a", "red", "seven", "on", "grass"), (3, 3, 0, 3, 4),
                          ("det", "amod", "root", "prep", "pobj"))
    triplets = tree_triplets(tree)
    assert [(t.index1, t.index2) for t in triplets] == [(2, 0), (2, 1), (2, 3), (3, 4)]
    assert Triplet("det", "seven", "a") == triplets[0]          # positions are not compared
    collapsed = tree_triplets(tree, collapse_prepositions=True)
    assert (collapsed[-1].relation, collapsed[-1].index1, collapsed[-1].index2) == ("prep_on", 2, 4)
    encoded = encode_fragments([triplets], ["amod", "pobj"], {w: i for i, w in enumerate(tree.words)},
                               words=[tree.words])
    assert encoded.positions.tolist() == [[2, 1], [3, 4]] and encoded.words == [tree.words]


def test_box_centres_and_unanswered_queries_in_the_pointing_game():
    queries = [_query((0, 3), BOX_A, index=0), _query((4, 7), BOX_B, index=1), _query((3, 4), WHOLE, index=2)]
    points = pg.box_centre_points(queries, [np.asarray(BOX_A), np.asarray([90, 90, 130, 140]), None])
    assert points == [(19, 19), (99, 99), None]             # floor of the centre; clipped to the image
    result = pg.evaluate_points(queries, points)
    assert (result["hits"], result["misses"], result["queries_without_point"]) == (1, 2, 1)
    with pytest.raises(UserInputError, match="empty"):
        pg.box_centre_points(queries[:1], [np.asarray([5, 5, 1, 1])])


def test_phrase_fingerprint_is_the_same_for_the_region_examples_and_the_pointing_queries(tmp_path):
    (tmp_path / "Sentences").mkdir()
    (tmp_path / "Annotations").mkdir()
    fe.write_sentence_file(tmp_path / "Sentences" / "42.txt", [fe.parse_sentence_line(line) for line in (
        "[/EN#1/people Two Young guys] look at [/EN#2/animals a dog] in [/EN#8/scene the yard] .",
        "[/EN#0/notvisual Someone] sees [/EN#3/other/clothing A red hat] .")])
    fe.write_annotation_file(tmp_path / "Annotations" / "42.xml", fe.ImageAnnotation(
        width=120, height=80, depth=3,
        boxes={"1": np.array([[0, 0, 19, 39], [60, 10, 79, 79]], np.float32),
               "2": np.array([[30, 50, 49, 69]], np.float32), "3": np.array([[100, 0, 119, 9]], np.float32)},
        scene_chains=["8"], nobox_chains=[]), "42.jpg")
    examples, _ = collect_phrase_examples(tmp_path, ["42"])
    queries = pg.pointing_queries(tmp_path, ["42"])
    assert len(queries) == len(examples) == 3                # the one phrase filter: visual, with a box
    assert phrase_fingerprint(examples) == phrase_fingerprint(queries) == phrase_fingerprint(queries[::-1])
    assert phrase_fingerprint(queries[:2]) != phrase_fingerprint(queries)
    moved = [pg.PointingQuery(**{**q.__dict__, "boxes": q.boxes + 1}) if i == 0 else q for i, q in enumerate(queries)]
    assert phrase_fingerprint(moved) != phrase_fingerprint(queries)
    summary = gr.grounding_summary(phrase_fingerprint(queries), len(queries), {"accuracy": 50.0}, rule="heat_map")
    assert summary["phrase_fingerprint"].startswith("sha256:") and summary["point"] == gr.POINT_RULES["heat_map"]
    with pytest.raises(UserInputError, match="unknown grounding rule"):
        gr.grounding_summary("sha256:x", 1, {"accuracy": 0.0}, rule="nope")
