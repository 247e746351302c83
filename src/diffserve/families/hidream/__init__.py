"""HiDream-I1 (Diffusers `HiDreamImagePipeline`): see `record.py`."""
