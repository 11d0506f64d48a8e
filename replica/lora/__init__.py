"""LoRA adapters in PEFT's format on top of the served model. By job: peft.py (read and check
an adapter), targets.py (the model's adaptable layers), layer.py (one layer's adapters and the
per-step product), model.py (install adapters in a rank's layers, sharded; the step's batch),
manager.py (the replica's LRU of adapters, pins, loads on demand)."""

from replica.lora.layer import LoRABatch, LoRAContext, LoRALinear
from replica.lora.manager import LoRAManager
from replica.lora.model import LoRAModel
from replica.lora.peft import PeftAdapter, read_adapter
from replica.lora.targets import LoRATargets, Target

__all__ = [
    "LoRABatch",
    "LoRAContext",
    "LoRALinear",
    "LoRAManager",
    "LoRAModel",
    "LoRATargets",
    "PeftAdapter",
    "Target",
    "read_adapter",
]
