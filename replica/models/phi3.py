"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama decoder (models/llama.py) with LongRoPE, partial
rotary (Phi-4-mini rotates 3/4 of each head) and a tied LM head where the config asks; both
in the rotary tables (layers/rotary.py). What differs is the checkpoint: it stores the
q/k/v and gate/up projections fused (qkv_proj, gate_up_proj), which the loader splits into
the parts our tensor-parallel layers shard one by one."""

from __future__ import annotations

from typing import Any

from replica.layers.linear import TensorParallel
from replica.models.llama import LlamaForCausalLM, head_dim_of, num_kv_heads_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, tp: TensorParallel | None = None) -> None:
        super().__init__(hf_config, tp)
        head_dim = head_dim_of(hf_config)
        q_rows = hf_config.num_attention_heads * head_dim
        kv_rows = num_kv_heads_of(hf_config) * head_dim
        inter = hf_config.intermediate_size
        # checkpoint tensor -> its parts, in row order, under the names stacked_params_mapping
        # maps onto our fused parameters (loader._checkpoint_parts)
        self.fused_checkpoint_tensors = {
            "qkv_proj": [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)],
            "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
        }
