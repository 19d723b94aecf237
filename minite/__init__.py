"""miniTE's command line and demo: wires the vLLM plugin, the Megatron spec and the core together."""
