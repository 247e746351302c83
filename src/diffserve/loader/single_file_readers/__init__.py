"""Readers of single-file DiT checkpoints (`.safetensors`, `.gguf`) as `TensorSource`s."""
