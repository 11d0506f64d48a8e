"""Quantized weights: GGUF block formats kept as they are (formats.py), the native kernels that
multiply by them (kernels.py), GGUF checkpoints (gguf_meta.py: config and tokenizer from the
metadata; gguf_weights.py: the tensors) and int8 quantization at load."""
