"""dspark: DSpark speculative decoding for Python.

Layers (data flows one way, top to bottom):

* ``dspark.engine``  -- target adapter, decoding loop, schedulers, ``LLM`` and ``generate``;
* ``dspark.model``   -- the DSpark draft model, its heads and checkpoint formats;
* ``dspark.kernels`` -- the DSpark kernel set (PyTorch reference + Triton), imports nothing above it.
"""

__version__ = "0.1.0"


__all__ = ["LLM", "StructuredOutputs", "generate", "__version__"]


def __getattr__(name: str):
    # `dspark.LLM` / `dspark.generate` without importing the engine (torch, transformers) on
    # `import dspark.kernels` or `dspark --help`.
    if name in ("LLM", "generate", "StructuredOutputs"):
        from .engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
