"""Hugging Face and consolidated-model I/O: config.json translation and folder checks, the
streaming safetensors reader (each rank reads only its slices; FP8 block-quantized weights
dequantized on the way) and writer, and export.

The package imports nothing heavy: launcher/hf/format.py is pure Python (the validator and the
planner use it); weights, fp8_blocks, tensor_stream and export import torch.
"""
