"""The sana family package: see `record.py` for what it serves."""
