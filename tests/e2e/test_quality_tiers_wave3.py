"""Approximate quality tiers (presets of the cache methods by name, issues 35/36) for HiDream-I1, HunyuanImage
2.1, Qwen-Image 2.1, HunyuanVideo 1.0 (T2V, I2V), CogVideoX (T2V, I2V), Mochi 1 and Chroma.

On each family's tiny random-weight checkpoint (what `diffserve make-tiny` writes), at the settings the
presets were chosen at (20 steps, each family's default guidance, the sizes below), on a prompt and seed the
choice did not use: every tier keeps its PSNR bar against the exact output (`high`), each tier computes
fewer steps in full than the tier above it (medium may compute all of them where nothing could be skipped
at its bar), and one DiT batch mixing the four tiers (the exact request on another prompt) gives each
request what it gets alone, with the same cache report. The figures each preset was chosen by are in the
comment above the family's `step_cache_policies`.
"""

from __future__ import annotations

from quality_tier_tests import TierCases, input_image, mixed_tiers_test, tier_case_fixture, tier_ladder_test

from diffserve.families.chroma.tiny import build_tiny_chroma
from diffserve.families.cogvideox.tiny import TinyCogVideoXSpec, build_tiny_cogvideox
from diffserve.families.hidream.tiny import build_tiny_hidream
from diffserve.families.hunyuan_image.tiny import build_tiny_hunyuan_image
from diffserve.families.hunyuan_video.image_to_video_tiny import build_tiny_hunyuan_video_i2v
from diffserve.families.hunyuan_video.tiny import build_tiny_hunyuan_video
from diffserve.families.mochi.tiny import build_tiny_mochi
from diffserve.families.qwen_image21.tiny import build_tiny_qwen_image21

STEPS = 20
PROMPT, SEED = "a red fox in the snow", 7
OTHER_PROMPT, OTHER_SEED = "a lighthouse on a rocky coast at dusk, oil painting", 8
CLIP = {"height": 32, "width": 32, "num_frames": 5}


#: name -> (builder of the model folder, generation kwargs; each family at its default guidance).
CASES: TierCases = {
    "hidream": (build_tiny_hidream, {"height": 32, "width": 32}),  # its area rule makes it 128x128
    "hunyuan-image-2.1": (build_tiny_hunyuan_image, {"height": 32, "width": 32}),
    "qwen-image-2.1": (build_tiny_qwen_image21, {"height": 64, "width": 64}),
    "hunyuan-video": (build_tiny_hunyuan_video, CLIP),
    "hunyuan-video-i2v": (build_tiny_hunyuan_video_i2v, {**CLIP, "input_images": [input_image()]}),
    "cogvideox": (build_tiny_cogvideox, CLIP),
    "cogvideox-i2v": (  # its DiT's learned positions are for 64x80 only
        lambda root: build_tiny_cogvideox(root, TinyCogVideoXSpec(image_to_video=True)),
        {**CLIP, "height": 64, "width": 80, "input_images": [input_image()]},
    ),
    "mochi": (build_tiny_mochi, {**CLIP, "num_frames": 7}),
    "chroma": (build_tiny_chroma, {"height": 64, "width": 64}),
}


family = tier_case_fixture(CASES, STEPS, PROMPT, SEED)
test_each_tier_keeps_its_bar_and_computes_fewer_steps_than_the_one_above = tier_ladder_test()
test_a_batch_mixing_the_tiers_gives_each_request_its_alone_output = mixed_tiers_test(OTHER_PROMPT, OTHER_SEED)
