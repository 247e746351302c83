"""HunyuanImage 2.1 (Diffusers `HunyuanImagePipeline`): the family's record is in `record.py`."""
