"""dspark: DSpark speculative decoding for Python.

Layers (data flows one way, top to bottom):

* ``dspark.engine``  -- target adapter, decoding loop, schedulers, ``generate``;
* ``dspark.model``   -- the DSpark draft model, its heads and checkpoint formats;
* ``dspark.kernels`` -- the DSpark kernel set (PyTorch reference + Triton), imports nothing above it.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `dspark.generate` without importing the engine (and transformers) on `import dspark.kernels`.
    if name == "generate":
        from .engine import generate

        return generate
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
