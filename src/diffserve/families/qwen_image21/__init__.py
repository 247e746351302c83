"""Qwen-Image 2.1 (Diffusers `QwenImage21Pipeline`); the family's record is in `record.py`."""
