"""miniTE's command line and demo: wire the vLLM plugin, the Megatron spec and the core."""
