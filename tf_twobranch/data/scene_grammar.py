"""Scene layout and caption grammar of the embedded digit-scene dataset.

A scene is a noisy, tinted background with 1-4 handwritten digits on it.
Each digit has a class (0-9), a colour, a size class and an exact box.
Two digits of the same class and colour always form one *plural entity*
("two red sevens"); otherwise every (class, colour) occurs at most once per
scene, so every phrase refers to exactly one coreference chain.

This module is pure Python + numpy: it decides *what* is in a scene and
*how it is described*. Rendering pixels and writing files is done by
:mod:`tf_twobranch.data.embedded`.

Captions mimic Flickr30K Entities: tokenised words separated by spaces, a
final " .", phrases annotated with a coreference chain and Flickr30K entity
types. Besides the digit phrases a caption may contain a scene phrase (the
background, type ``scene``, no box), a non-visual phrase ("this picture",
chain ``"0"``, type ``notvisual``) or a phrase for the unseen writer
("someone", type ``people``, a chain without a box).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIGIT_PLURALS = ("zeros", "ones", "twos", "threes", "fours", "fives", "sixes", "sevens", "eights", "nines")

# Fixed digit class -> Flickr30K Entities type table, so that per-type
# breakdowns of phrase-localization results are meaningful (every visual
# Flickr30K type except ``scene`` gets at least one class).
ENTITY_TYPE_BY_DIGIT = {
    0: "other",
    1: "people",
    2: "animals",
    3: "clothing",
    4: "vehicles",
    5: "bodyparts",
    6: "instruments",
    7: "people",
    8: "animals",
    9: "other",
}
SCENE_TYPE = "scene"
NOTVISUAL_TYPE = "notvisual"
NOTVISUAL_CHAIN_ID = "0"

# Object colours (RGB) and their caption words. The first word is the
# canonical name; the others are rarer synonyms.
OBJECT_COLOURS = {
    "red": (220, 30, 30),
    "green": (40, 190, 50),
    "blue": (40, 80, 235),
    "yellow": (235, 220, 40),
    "purple": (150, 50, 200),
    "orange": (245, 140, 20),
    "white": (240, 240, 240),
    "cyan": (40, 220, 225),
}
COLOUR_SYNONYMS = {
    "red": ("crimson", "scarlet"),
    "green": ("emerald", "lime"),
    "blue": ("bright blue",),
    "yellow": ("golden",),
    "purple": ("violet",),
    "orange": ("amber",),
    "white": ("pale",),
    "cyan": ("turquoise", "light blue"),
}
COLOUR_NAMES = tuple(OBJECT_COLOURS)

# Glyph side lengths (pixels, before rotation) of each size class for a
# 96-pixel image; scaled proportionally for other image sizes.
SIZE_RANGES_96 = {"small": (14, 20), "medium": (22, 30), "large": (32, 40)}
SIZE_NAMES = tuple(SIZE_RANGES_96)
SIZE_WORDS = {
    "small": ("small", "tiny", "little"),
    "medium": ("medium-sized", "mid-sized"),
    "large": ("big", "large", "huge"),
}

# Background tints (RGB means are darkish so that every object colour,
# including white, stands out) and their words.
BACKGROUND_TINTS = {
    "grey": (95, 95, 95),
    "brown": (100, 70, 45),
    "navy": (30, 35, 90),
    "olive": (80, 85, 35),
    "black": (25, 25, 25),
}
BACKGROUND_TEXTURES = ("noisy", "grainy", "speckled", "textured", "mottled")

COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


@dataclasses.dataclass(frozen=True)
class SceneObject:
    """One rendered digit.

    ``box`` is (x1, y1, x2, y2), 0-based inclusive pixel indices, the tight
    box of the glyph's visible pixels (filled in by the renderer).
    """

    digit: int
    colour: str
    size: str
    glyph_index: int
    side: int
    box: tuple[int, int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class SceneEntity:
    """A mentionable thing: one object, or a plural group of two objects of
    the same class and colour. One coreference chain per entity."""

    chain_id: str
    digit: int
    colour: str
    object_indices: tuple[int, ...]
    size: str | None  # None when the grouped objects differ in size

    @property
    def is_plural(self) -> bool:
        return len(self.object_indices) > 1

    @property
    def entity_type(self) -> str:
        return ENTITY_TYPE_BY_DIGIT[self.digit]


@dataclasses.dataclass(frozen=True)
class GrammarPhrase:
    """An annotated phrase of a generated caption (word span + chain)."""

    first_word_index: int
    words: tuple[str, ...]
    chain_id: str
    phrase_types: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclasses.dataclass(frozen=True)
class GrammarCaption:
    """A generated caption: tokenised words and its annotated phrases."""

    words: tuple[str, ...]
    phrases: tuple[GrammarPhrase, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclasses.dataclass(frozen=True)
class SceneBackground:
    tint: str
    texture: str


@dataclasses.dataclass(frozen=True)
class SceneLayoutPlan:
    """What a scene should contain before rendering (no boxes yet)."""

    background: SceneBackground
    objects: tuple[SceneObject, ...]
    plural_pairs: tuple[tuple[int, int], ...]


def size_range(size: str, image_size: int) -> tuple[int, int]:
    """Glyph side range (pixels) of a size class at ``image_size``."""
    low, high = SIZE_RANGES_96[size]
    scale = image_size / 96.0
    return max(4, int(round(low * scale))), max(5, int(round(high * scale)))


def plan_scene(
    rng: np.random.Generator,
    glyph_indices_by_digit: Sequence[Sequence[int]],
    image_size: int,
    *,
    max_objects: int = 4,
    plural_probability: float = 0.2,
) -> SceneLayoutPlan:
    """Draws the content of one scene: background, digits and plural pairs.

    Every (digit, colour) pair is distinct among entities; a plural pair is
    two objects with equal digit and colour (different glyph samples).
    """
    background = SceneBackground(
        tint=_pick(rng, list(BACKGROUND_TINTS)),
        texture=_pick(rng, BACKGROUND_TEXTURES),
    )
    # Skewed towards 2-3 objects, as Flickr30K images mention ~3 entities.
    num_objects = 1 + weighted_index(rng, [0.2, 0.35, 0.3, 0.15][:max_objects])
    used_pairs: set[tuple[int, str]] = set()
    objects: list[SceneObject] = []
    plural_pairs: list[tuple[int, int]] = []
    while len(objects) < num_objects:
        make_plural = (
            objects
            and not plural_pairs
            and rng.random() < plural_probability
            and len(objects) < num_objects
        )
        if make_plural:
            source_index = uniform_index(rng, len(objects))
            source = objects[source_index]
            digit, colour = source.digit, source.colour
            # Plural partners usually share the size class.
            size = source.size if rng.random() < 0.7 else _pick(rng, SIZE_NAMES)
        else:
            while True:
                digit = uniform_index(rng, 10)
                colour = _pick(rng, COLOUR_NAMES)
                if (digit, colour) not in used_pairs:
                    break
            size = _pick(rng, SIZE_NAMES, [0.35, 0.4, 0.25])
        pool = glyph_indices_by_digit[digit]
        glyph_index = int(pool[uniform_index(rng, len(pool))])
        low, high = size_range(size, image_size)
        side = low + uniform_index(rng, high - low + 1)
        if make_plural:
            plural_pairs.append((source_index, len(objects)))
        used_pairs.add((digit, colour))
        objects.append(SceneObject(digit, colour, size, glyph_index, side))
    return SceneLayoutPlan(background, tuple(objects), tuple(plural_pairs))


def group_entities(
    objects: Sequence[SceneObject],
    plural_pairs: Sequence[tuple[int, int]],
    next_chain_id: int,
) -> tuple[list[SceneEntity], int]:
    """Groups placed objects into entities with fresh chain ids.

    Returns the entities and the next unused chain id. A plural pair whose
    partner was dropped during placement becomes a singular entity.
    """
    present = set(range(len(objects)))
    groups: list[tuple[int, ...]] = []
    grouped: set[int] = set()
    for first, second in plural_pairs:
        if first in present and second in present:
            groups.append((first, second))
            grouped.update((first, second))
    for index in range(len(objects)):
        if index not in grouped:
            groups.append((index,))
    groups.sort(key=min)
    entities = []
    for group in groups:
        sizes = {objects[i].size for i in group}
        entities.append(
            SceneEntity(
                chain_id=str(next_chain_id),
                digit=objects[group[0]].digit,
                colour=objects[group[0]].colour,
                object_indices=group,
                size=sizes.pop() if len(sizes) == 1 else None,
            )
        )
        next_chain_id += 1
    return entities, next_chain_id


# --------------------------------------------------------------------------
# Caption grammar
# --------------------------------------------------------------------------

class _CaptionBuilder:
    """Accumulates words and phrase annotations of one caption."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self.phrases: list[GrammarPhrase] = []

    def add(self, text: str) -> None:
        self.words.extend(text.split())

    def add_phrase(self, words: Sequence[str], chain_id: str, phrase_types: Sequence[str]) -> None:
        words = [word for chunk in words for word in chunk.split()]
        self.phrases.append(GrammarPhrase(len(self.words), tuple(words), chain_id, tuple(phrase_types)))
        self.words.extend(words)

    def finish(self) -> GrammarCaption:
        words = list(self.words)
        if words[-1] != ".":
            words.append(".")
        words[0] = words[0][:1].upper() + words[0][1:]
        phrases = []
        for phrase in self.phrases:
            # Keep phrase text identical to the (capitalised) caption words.
            span = tuple(words[phrase.first_word_index:phrase.first_word_index + len(phrase.words)])
            phrases.append(dataclasses.replace(phrase, words=span))
        return GrammarCaption(tuple(words), tuple(phrases))


def _pick(rng: np.random.Generator, options: Sequence[str], weights: Sequence[float] | None = None) -> str:
    if weights is None:
        return options[uniform_index(rng, len(options))]
    return options[weighted_index(rng, weights)]


def uniform_index(rng: np.random.Generator, n: int) -> int:
    """Uniform index in [0, n) (much cheaper than Generator.integers)."""
    return min(n - 1, int(rng.random() * n))


def weighted_index(rng: np.random.Generator, weights: Sequence[float]) -> int:
    """Index drawn with probabilities proportional to ``weights``."""
    target = rng.random() * sum(weights)
    cumulative = 0.0
    for index, weight in enumerate(weights):
        cumulative += weight
        if target < cumulative:
            return index
    return len(weights) - 1


def _indefinite_article(next_word: str) -> str:
    word = next_word.lower()
    if word in ("one", "1") or word.startswith("uni"):
        return "a"
    return "an" if word[:1] in "aeiou8" else "a"


def _colour_words(colour: str, rng: np.random.Generator) -> list[str]:
    if rng.random() < 0.12:
        return _pick(rng, COLOUR_SYNONYMS[colour]).split()
    return [colour]


def _entity_key(entity: SceneEntity, attributes: frozenset[str]) -> tuple:
    # Plurality is deliberately not part of the key: "a white digit" next
    # to "two white sixes" is too vague even though grammatically distinct.
    return (
        entity.digit if "digit" in attributes else None,
        entity.colour if "colour" in attributes else None,
        entity.size if "size" in attributes else None,
    )


# Attribute subsets a phrase may mention, with their probabilities.
_ATTRIBUTE_CHOICES = (
    (frozenset({"digit", "colour"}), 0.45),
    (frozenset({"digit", "colour", "size"}), 0.2),
    (frozenset({"digit"}), 0.13),
    (frozenset({"colour"}), 0.1),
    (frozenset({"digit", "size"}), 0.12),
)


def _choose_attributes(entity: SceneEntity, entities: Sequence[SceneEntity], rng: np.random.Generator) -> frozenset[str]:
    """Picks which attributes a phrase mentions, keeping it unambiguous
    among the scene's entities (falls back to digit + colour, which is
    unique by construction)."""
    index = weighted_index(rng, [w for _, w in _ATTRIBUTE_CHOICES])
    attributes = _ATTRIBUTE_CHOICES[index][0]
    if "size" in attributes and entity.size is None:
        attributes = attributes - {"size"} | {"colour", "digit"}
    key = _entity_key(entity, attributes)
    if any(other is not entity and _entity_key(other, attributes) == key for other in entities):
        attributes = frozenset({"digit", "colour"})
    return attributes


def noun_phrase_words(
    entity: SceneEntity,
    attributes: frozenset[str],
    rng: np.random.Generator,
    *,
    definite: bool = False,
) -> list[str]:
    """Realises a noun phrase for ``entity`` mentioning ``attributes``."""
    size_words = [_pick(rng, SIZE_WORDS[entity.size])] if "size" in attributes and entity.size else []
    colour_words = _colour_words(entity.colour, rng) if "colour" in attributes else []
    colour_after = bool(colour_words) and rng.random() < 0.15  # "a seven in red"
    if entity.is_plural:
        if "digit" in attributes:
            noun = _pick(
                rng,
                [DIGIT_PLURALS[entity.digit], f"digit {DIGIT_PLURALS[entity.digit]}", f"{entity.digit}s",
                 f"handwritten {DIGIT_PLURALS[entity.digit]}"],
                [0.55, 0.1, 0.15, 0.2],
            ).split()
        else:
            noun = [_pick(rng, ["digits", "numbers", "numerals", "figures"], [0.5, 0.3, 0.1, 0.1])]
        determiner = _pick(rng, ["two", "a pair of", "the two"] if definite else ["two", "a pair of"]).split()
    else:
        if "digit" in attributes:
            noun = _pick(
                rng,
                [DIGIT_WORDS[entity.digit], f"digit {DIGIT_WORDS[entity.digit]}", f"number {DIGIT_WORDS[entity.digit]}",
                 f"number {entity.digit}", str(entity.digit), f"handwritten {DIGIT_WORDS[entity.digit]}"],
                [0.4, 0.15, 0.1, 0.1, 0.1, 0.15],
            ).split()
        else:
            noun = [_pick(rng, ["digit", "number", "numeral", "figure"], [0.5, 0.3, 0.1, 0.1])]
        determiner = None
    middle = size_words + ([] if colour_after else colour_words) + noun
    if colour_after:
        middle += ["in"] + colour_words
    if determiner is None:
        determiner = ["the"] if definite else [_indefinite_article(middle[0])]
        if not definite and entity.digit != 1 and rng.random() < 0.08:
            determiner = ["one"]
    return determiner + middle


def _merged_box(entity: SceneEntity, objects: Sequence[SceneObject]) -> tuple[float, float, float, float]:
    boxes = np.array([objects[i].box for i in entity.object_indices], dtype=np.float64)
    return boxes[:, 0].min(), boxes[:, 1].min(), boxes[:, 2].max(), boxes[:, 3].max()


def spatial_relation(
    subject: SceneEntity, reference: SceneEntity, objects: Sequence[SceneObject], rng: np.random.Generator
) -> str:
    """Relation words for "subject REL reference" from the boxes' geometry."""
    sx1, sy1, sx2, sy2 = _merged_box(subject, objects)
    rx1, ry1, rx2, ry2 = _merged_box(reference, objects)
    dx = (sx1 + sx2) / 2 - (rx1 + rx2) / 2
    dy = (sy1 + sy2) / 2 - (ry1 + ry2) / 2
    gap = max(rx1 - sx2, sx1 - rx2, ry1 - sy2, sy1 - ry2)
    if gap < 6 and rng.random() < 0.3:
        return _pick(rng, ["next to", "beside", "near"])
    if abs(dx) >= abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return _pick(rng, ["above", "over"]) if dy < 0 else _pick(rng, ["below", "under"])


def location_words(entity: SceneEntity, objects: Sequence[SceneObject], image_size: int) -> str:
    """Where an entity is in the picture ("in the top left corner", ...)."""
    x1, y1, x2, y2 = _merged_box(entity, objects)
    column = min(2, int(3 * ((x1 + x2) / 2) / image_size))
    row = min(2, int(3 * ((y1 + y2) / 2) / image_size))
    vertical = ("top", "middle", "bottom")[row]
    horizontal = ("left", "centre", "right")[column]
    if row == 1 and column == 1:
        return "in the middle"
    if row == 1:
        return f"on the {horizontal} side"
    if column == 1:
        return f"at the {vertical}"
    return f"in the {vertical} {horizontal} corner"


def _scene_phrase_words(background: SceneBackground, rng: np.random.Generator) -> list[str]:
    form = weighted_index(rng, [0.35, 0.3, 0.2, 0.15])
    if form == 0:
        return ["a", background.texture, background.tint, "background"]
    if form == 1:
        return [_indefinite_article(background.tint), background.tint, "background"]
    if form == 2:
        return [_indefinite_article(background.texture), background.texture, "background"]
    return ["a", "noisy", "background"]


def describe_scene(
    entities: Sequence[SceneEntity],
    objects: Sequence[SceneObject],
    background: SceneBackground,
    rng: np.random.Generator,
    *,
    image_size: int,
    scene_chain_id: str,
    writer_chain_id: str,
    num_captions: int = 5,
) -> list[GrammarCaption]:
    """Generates ``num_captions`` captions of one scene.

    One caption (at a random position) mentions every entity; the others
    mention random non-empty subsets, so some objects are distractors for
    some captions. ``scene_chain_id`` is the chain of background phrases and
    ``writer_chain_id`` the chain of the (box-less) "someone" phrases.
    """
    if not entities:
        raise ValueError("a scene needs at least one entity to be described")
    full_index = uniform_index(rng, num_captions)
    captions = []
    for caption_index in range(num_captions):
        if caption_index == full_index or len(entities) == 1:
            mentioned = list(entities)
            order = rng.permutation(len(mentioned))
            mentioned = [mentioned[i] for i in order]
        else:
            count = 1 if rng.random() < 0.45 else 1 + uniform_index(rng, len(entities))
            chosen = rng.permutation(len(entities))[:count]
            mentioned = [entities[int(i)] for i in chosen]
        captions.append(
            _realise_caption(mentioned, entities, objects, background, rng, image_size, scene_chain_id, writer_chain_id)
        )
    return captions


def _add_entity(builder: _CaptionBuilder, entity: SceneEntity, entities, rng, *, definite: bool = False) -> None:
    attributes = _choose_attributes(entity, entities, rng)
    words = noun_phrase_words(entity, attributes, rng, definite=definite)
    builder.add_phrase(words, entity.chain_id, [entity.entity_type])


def _add_entity_list(builder: _CaptionBuilder, mentioned, entities, rng) -> None:
    for position, entity in enumerate(mentioned):
        if position > 0:
            builder.add("and" if position == len(mentioned) - 1 else ",")
        _add_entity(builder, entity, entities, rng)


def _add_scene(builder: _CaptionBuilder, background, rng, scene_chain_id: str) -> None:
    builder.add_phrase(_scene_phrase_words(background, rng), scene_chain_id, [SCENE_TYPE])


def _realise_caption(mentioned, entities, objects, background, rng, image_size, scene_chain_id, writer_chain_id):
    builder = _CaptionBuilder()
    is_full = len(mentioned) == len(entities)
    is_many = len(mentioned) > 1 or mentioned[0].is_plural
    templates = ["list", "there_is", "fragment", "this_picture", "drawn_on"]
    weights = [0.2, 0.2, 0.2, 0.1, 0.1]
    if len(mentioned) >= 2:
        templates.append("relation")
        weights.append(0.35)
    if len(mentioned) == 1:
        templates.append("location")
        weights.append(0.25)
    templates.append("someone")
    weights.append(0.05)
    if is_full:
        templates.append("count")
        weights.append(0.1)
    template = _pick(rng, templates, weights)

    if template == "list":
        builder.add(_pick(rng, ["a picture showing", "an image of", "a photo with", "a picture of"]))
        _add_entity_list(builder, mentioned, entities, rng)
    elif template == "there_is":
        builder.add("there are" if is_many else "there is")
        _add_entity_list(builder, mentioned, entities, rng)
        builder.add("on")
        _add_scene(builder, background, rng, scene_chain_id)
    elif template == "fragment":
        _add_entity_list(builder, mentioned, entities, rng)
        if rng.random() < 0.5:
            builder.add("on")
            _add_scene(builder, background, rng, scene_chain_id)
    elif template == "this_picture":
        builder.add_phrase(
            _pick(rng, ["this picture", "this image", "the image"]).split(), NOTVISUAL_CHAIN_ID, [NOTVISUAL_TYPE]
        )
        builder.add(_pick(rng, ["shows", "contains"]))
        _add_entity_list(builder, mentioned, entities, rng)
    elif template == "drawn_on":
        _add_entity_list(builder, mentioned, entities, rng)
        builder.add(",")
        builder.add(_pick(rng, ["drawn on", "written on", "painted on"]))
        _add_scene(builder, background, rng, scene_chain_id)
    elif template == "relation":
        subject, reference, rest = mentioned[0], mentioned[1], mentioned[2:]
        relation = spatial_relation(subject, reference, objects, rng)
        _add_entity(builder, subject, entities, rng)
        builder.add("are" if subject.is_plural else "is")
        builder.add(relation)
        _add_entity(builder, reference, entities, rng, definite=rng.random() < 0.3)
        if rest:
            builder.add(", and there " + ("is also" if len(rest) == 1 and not rest[0].is_plural else "are also"))
            _add_entity_list(builder, rest, entities, rng)
    elif template == "location":
        entity = mentioned[0]
        _add_entity(builder, entity, entities, rng)
        if rng.random() < 0.5:
            builder.add(("are" if entity.is_plural else "is") + " " + location_words(entity, objects, image_size))
        else:
            builder.add(location_words(entity, objects, image_size) + " of")
            _add_scene(builder, background, rng, scene_chain_id)
    elif template == "count":
        num_objects = sum(len(entity.object_indices) for entity in mentioned)
        builder.add(COUNT_WORDS[num_objects] + " " + _pick(rng, ["digits", "numbers", "handwritten digits"]) + " :")
        if num_objects == 1:
            builder.words[-2] = builder.words[-2][:-1]  # "one digit"
        _add_entity_list(builder, mentioned, entities, rng)
    else:  # someone
        builder.add_phrase([_pick(rng, ["someone", "somebody", "a person"])], writer_chain_id, ["people"])
        builder.add(_pick(rng, ["wrote", "drew"]))
        _add_entity_list(builder, mentioned, entities, rng)
        builder.add("on")
        _add_scene(builder, background, rng, scene_chain_id)
    return builder.finish()


def caption_mentions(caption: GrammarCaption) -> set[str]:
    """Chain ids mentioned by a caption (all phrase types)."""
    return {phrase.chain_id for phrase in caption.phrases}
