"""The hunyuan_video15 family package: see `record.py` for what it serves."""
