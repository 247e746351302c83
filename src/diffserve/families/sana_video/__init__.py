"""SANA-Video (Diffusers' `SanaVideoPipeline`): see `record.py`."""
