"""dspark: DSpark speculative decoding for Python.

Layers (data flows one way, top to bottom):

* ``dspark.engine``  -- target adapter, decoding loop, schedulers, ``generate``;
* ``dspark.model``   -- the DSpark draft model, its heads and checkpoint formats;
* ``dspark.kernels`` -- the DSpark kernel set (PyTorch reference + Triton), imports nothing above it.
"""

__version__ = "0.1.0"
