"""Quantized weights: GGUF block formats kept as they are (formats.py), the native kernels that
multiply by them (kernels.py), quantized weights inside the model's layers (weights.py: what a
linear or embedding layer holds instead of a float Parameter, and int8 quantization at load),
GGUF checkpoints (gguf_meta.py: config and tokenizer from the metadata; gguf_weights.py: the
tensors under our names)."""
