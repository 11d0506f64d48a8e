"""Building blocks of the decoder models: tensor-parallel linear and embedding layers, RMSNorm,
rotary embedding, paged attention and the sampler."""
