"""The flux2 family package: see `record.py` for what it serves."""
