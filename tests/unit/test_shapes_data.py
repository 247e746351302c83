"""The demo model's procedural dataset: deterministic, and the held-out split really is held out."""

from __future__ import annotations

import numpy as np
import pytest

from diffserve.demo import shapes_data as sd


def test_vocabulary_and_captions():
    attrs = sd.Attributes("triangle", "yellow", "large", "bottom right", "gray")
    assert sd.caption(attrs) == "a large yellow triangle at the bottom right on a gray background"
    assert sd.caption(sd.Attributes("circle", "red", "small", "center", "black")) == (
        "a small red circle in the center on a black background"
    )
    vocab = sd.vocabulary()
    assert len(vocab) == len(set(vocab)) == 25
    assert all(word in vocab for a in sd.all_combinations() for word in sd.caption(a).split())
    # Shape colours and background colours are different words and far apart in RGB.
    assert not set(sd.SHAPE_COLOURS) & set(sd.BACKGROUND_COLOURS)
    palette = {**sd.SHAPE_COLOURS, **sd.BACKGROUND_COLOURS}
    rgb = np.array(list(palette.values()), dtype=float)
    distances = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1) + np.eye(len(rgb)) * 1e9
    assert distances.min() > 200


def test_unknown_attribute_is_an_error():
    with pytest.raises(ValueError, match="unknown colour 'orange'"):
        sd.Attributes("circle", "orange", "small", "center", "black")


def test_combinations_and_split():
    combos = sd.all_combinations()
    assert len(combos) == 3 * 6 * 2 * 5 * 3 == len(set(combos))
    held = sd.held_out_combinations()
    assert len(held) >= 24 and len(set(held)) == len(held)
    assert held == sd.held_out_combinations()  # deterministic
    # Every colour and every position is represented among the held-out combinations.
    assert {c.colour for c in held} == set(sd.SHAPE_COLOURS)
    assert {c.position for c in held} == set(sd.POSITIONS)
    training = sd.training_combinations()
    assert len(training) + 2 * len(held) == len(combos)
    assert not {a.combination for a in training} & set(held)
    assert all(sd.is_held_out(a) for a in sd.held_out_attributes())


def test_render_is_deterministic_and_draws_what_it_says():
    attrs = sd.Attributes("square", "blue", "large", "top left", "white")
    a, b = np.asarray(sd.render(attrs)), np.asarray(sd.render(attrs))
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert tuple(a[16, 16]) == sd.SHAPE_COLOURS["blue"]
    assert tuple(a[48, 48]) == sd.BACKGROUND_COLOURS["white"]
    shifted = np.asarray(sd.render(attrs, offset=(2, -1)))
    assert not np.array_equal(a, shifted)


def test_dataset_is_deterministic_and_excludes_held_out_captions():
    first = sd.make_dataset(300, seed=7)
    second = sd.make_dataset(300, seed=7)
    np.testing.assert_array_equal(first.images, second.images)
    assert first.captions == second.captions
    assert sd.make_dataset(300, seed=8).captions != first.captions
    held_captions = {sd.caption(a) for a in sd.held_out_attributes()}
    assert not held_captions & set(first.captions)
    big = sd.make_dataset(3000, seed=0)
    assert not held_captions & set(big.captions)
    assert not any(sd.is_held_out(a) for a in big.attributes)
