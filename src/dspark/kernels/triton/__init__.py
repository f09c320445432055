"""Triton backend (GPU; CPU under TRITON_INTERPRET=1)."""
