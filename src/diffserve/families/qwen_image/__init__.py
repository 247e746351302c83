"""The qwen_image family package: see `record.py` for what it serves."""
