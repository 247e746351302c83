"""The shipped demo model's world: a procedural "coloured shapes" dataset and its adherence check.

`shapes_data` draws 64x64 images of one shape from a small explicit vocabulary and captions them;
`shapes_eval` measures whether an image shows what its caption asks for. `tools/train_demo_model.py`
trains the demo FLUX model on this data; `tests/e2e/test_demo_model.py` measures it with the check.
"""
