"""The sd3 family package: see `record.py` for what it serves."""
