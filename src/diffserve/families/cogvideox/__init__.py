"""CogVideoX 1.0 and 1.5 (Diffusers' `CogVideoXPipeline`, `CogVideoXImageToVideoPipeline`): see `record.py`."""
