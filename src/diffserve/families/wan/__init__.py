"""The wan family package: see `record.py` for what it serves."""
