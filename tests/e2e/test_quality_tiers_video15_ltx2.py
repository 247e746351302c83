"""Approximate quality tiers (presets of the cache methods by name, issue 36) for HunyuanVideo 1.5 (T2V, I2V)
and LTX-2 (T2V, I2V), which served `high` only until their DiTs took the cache methods.

On each family's tiny random-weight checkpoint (what `diffserve make-tiny` writes), at the settings the
presets were chosen at (20 steps, each family's default guidance, the sizes below), on a prompt and seed the
choice did not use: every tier keeps its PSNR bar against the exact output (`high`), each tier computes
fewer steps in full than the tier above it, and one DiT batch mixing the four tiers (the exact request on
another prompt) gives each request what it gets alone, with the same cache report. The figures each preset
was chosen by are in the comment above the family's `step_cache_policies`.
"""

from __future__ import annotations

from quality_tier_tests import TierCases, input_image, mixed_tiers_test, tier_case_fixture, tier_ladder_test

from diffserve.families.hunyuan_video15.tiny import TinyHunyuanVideo15Spec, build_tiny_hunyuan_video15
from diffserve.families.ltx2.tiny import TinyLTX2Spec, build_tiny_ltx2

STEPS = 20
PROMPT, SEED = "a red fox in the snow", 7
OTHER_PROMPT, OTHER_SEED = "a lighthouse on a rocky coast at dusk, oil painting", 8
HV15_CLIP = {"height": 32, "width": 32, "num_frames": 5}
LTX2_CLIP = {"height": 64, "width": 64, "num_frames": 9}


#: name -> (builder of the model folder, generation kwargs; each family at its default guidance).
CASES: TierCases = {
    "hunyuan-video-1.5": (build_tiny_hunyuan_video15, HV15_CLIP),
    "hunyuan-video-1.5-i2v": (
        lambda root: build_tiny_hunyuan_video15(root, TinyHunyuanVideo15Spec(image_to_video=True)),
        {**HV15_CLIP, "input_images": [input_image()]},
    ),
    "ltx2": (build_tiny_ltx2, LTX2_CLIP),
    "ltx2-i2v": (  # the T2V presets, inherited
        lambda root: build_tiny_ltx2(root, TinyLTX2Spec(image_to_video=True)),
        {**LTX2_CLIP, "input_images": [input_image()]},
    ),
}


family = tier_case_fixture(CASES, STEPS, PROMPT, SEED)
test_each_tier_keeps_its_bar_and_computes_fewer_steps_than_the_one_above = tier_ladder_test()
test_a_batch_mixing_the_tiers_gives_each_request_its_alone_output = mixed_tiers_test(OTHER_PROMPT, OTHER_SEED)
