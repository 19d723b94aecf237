"""Registration with Megatron-Bridge's parameter-mapping registry, when it is installed.

Megatron-Bridge (used by NeMo-RL and verl to export Megatron weights to HF names) detects a
module's tensor-parallel layout from its class name; miniTE's linears shard like Megatron's.
"""

from __future__ import annotations


def register_with_megatron_bridge() -> bool:
    """Register the miniTE linears as column/row parallel; False if Megatron-Bridge is absent."""
    try:
        from megatron.bridge.models.conversion.param_mapping import AutoMapping
    except ImportError:
        return False
    AutoMapping.register_module_type("MiniTEColumnParallelLinear", "column")
    AutoMapping.register_module_type("MiniTERowParallelLinear", "row")
    return True
