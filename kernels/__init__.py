"""miniTE's Triton kernels (imported as ``minite_kernels``), reached through ``minite_common``."""
