"""Hugging Face and consolidated-model I/O: config.json translation and folder checks, the
streaming safetensors reader (each rank reads only its slices) and writer, and export.

The package imports nothing heavy: launcher/hf/format.py is pure Python (the validator and the
planner use it); weights, tensor_stream and export import torch.
"""
