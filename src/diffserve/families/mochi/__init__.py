"""Mochi 1 (Diffusers `MochiPipeline`): see `record.py`."""
