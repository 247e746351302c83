"""The LongCat-Image family (Diffusers `LongCatImagePipeline`): see `record.py`."""
