"""The DSpark kernel set of TensorRT-Edge-LLM as Python functions (``import dspark.kernels as K``).

Families (one module each): ``markov`` (Markov correction, fused greedy steps, FP8 W2, whole-round
greedy drafter), ``sampling`` (uniforms, probabilities, samplers, stores), ``verify`` (verify tokens,
greedy and probabilistic accept, proposal lengths), ``confidence`` (confidence head and the
threshold / SPS schedulers), ``layers`` (RMSNorm, RoPE + KV store, cached attention, SwiGLU for the
engine's model runners). Backends: PyTorch reference and Triton, see ``use_backend``.
"""

from ._backend import backend_name, forced_backend, use_backend
from .confidence import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .rng import *  # noqa: F401,F403
from .markov import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
from .verify import *  # noqa: F401,F403
