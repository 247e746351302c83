"""Chroma (Diffusers `ChromaPipeline`): see `record.py`."""
