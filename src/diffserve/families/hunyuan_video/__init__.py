"""HunyuanVideo 1.0 (Diffusers `HunyuanVideoPipeline`): see `record.py`."""
