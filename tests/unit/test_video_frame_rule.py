"""Issue 31 item 4: a frame count over a video model's maximum is refused as too many, and the values
suggested are valid ones within range (not the next 4k+1 counts above the request, themselves too many)."""

from __future__ import annotations

import re

import pytest

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError
from diffserve.stages.input_validation import VideoRule


def message(rule: VideoRule, num_frames: int) -> str:
    with pytest.raises(InvalidRequestError) as info:
        rule.check(SamplingParams(prompt="a fox", num_frames=num_frames, fps=16, video_format="mp4"))
    assert info.value.param == "num_frames"
    return str(info.value)


def suggested(text: str) -> list[int]:
    return [int(n) for n in re.search(r"try (\d+)(?: or (\d+))?$", text).groups() if n is not None]


@pytest.mark.parametrize(
    ("rule", "num_frames", "expected"),
    [
        (VideoRule(4, 1025), 100001, [1025, 1021]),  # the case (Wan: 4k+1, at most 1025)
        (VideoRule(4, 1025), 1029, [1025, 1021]),  # 4k+1 itself, one group too many
        (VideoRule(4, 1025), 1026, [1025, 1021]),
        (VideoRule(8, 1025), 5000, [1025, 1017]),  # LTX-2's 8k+1
        (VideoRule(4, 81), 85, [81, 77]),
    ],
)
def test_over_the_maximum_says_at_most_and_suggests_values_in_range(rule, num_frames, expected) -> None:
    text = message(rule, num_frames)
    assert f"at most {rule.max_frames}" in text and f"got {num_frames}" in text, text
    assert suggested(text) == expected, text
    for n in expected:  # each suggestion is accepted
        rule.check(SamplingParams(prompt="a fox", num_frames=n, fps=16, video_format="mp4"))


@pytest.mark.parametrize(
    ("rule", "num_frames", "expected"),
    [
        (VideoRule(4, 1025), 6, [5, 9]),
        (VideoRule(4, 1025), 1024, [1021, 1025]),
        (VideoRule(4, 83), 83, [81]),  # a maximum that is not 4k+1 itself: 85 would be over it
        (VideoRule(8, 1025), 0, [1, 9]),
    ],
)
def test_a_count_off_the_grid_suggests_its_valid_neighbours_in_range(rule, num_frames, expected) -> None:
    text = message(rule, num_frames)
    assert f"must be {rule.temporal_factor}k+1" in text, text
    assert suggested(text) == expected, text
    for n in expected:
        rule.check(SamplingParams(prompt="a fox", num_frames=n, fps=16, video_format="mp4"))
