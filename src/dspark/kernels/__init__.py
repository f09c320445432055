"""The DSpark kernel set of TensorRT-Edge-LLM as Python functions (``import dspark.kernels as K``).

Families (one module each): ``markov`` (Markov correction, fused greedy steps, FP8 W2, whole-round
greedy drafter), ``sampling`` (uniforms, probabilities -- NVIDIA's filters and the engine's vLLM ones
--, samplers, stores, the sampled Markov steps),
``candidates`` (sampled Markov drafting over candidate sets), ``verify`` (verify tokens, greedy and
probabilistic accept, proposal lengths), ``confidence`` (confidence head and the threshold / SPS
schedulers), ``layers`` (RMSNorm, RoPE + KV store, cached
attention, SwiGLU for the engine's model runners), ``recurrent`` (a hybrid target's gated DeltaNet
and Mamba-2 windows with the state after every position written out, and their short causal conv),
``rng`` (request-stable uniforms), ``tree`` (the DDTree builder and greedy tree acceptance; PyTorch
only so far). Backends: PyTorch reference and Triton, see ``use_backend``; the full contract of each
function is on the public function.

Scratch memory: the Triton ops that need it (``logits_to_probabilities``, ``request_probabilities``,
``markov_sample_step``, ``vanilla_markov_sample``, ``sample_probability_rows``, ``greedy_accept``,
``probabilistic_accept``)
take ``workspace=`` -- a ``Workspace`` the caller owns (without one, a private default). A workspace
grows only outside CUDA-graph capture (inside, needing more raises ``RuntimeError``), keeps what a
captured graph may use alive, and ``Workspace.reserve`` sizes it once for the largest shapes.

Value checks (NaN logits of greedy decisions, probabilities that are not distributions, token ids
out of range) run for CPU tensors; on CUDA only with ``DSPARK_CHECK_VALUES=1`` (each costs a host
synchronisation), see ``dspark.kernels._validate``.
"""

from ._backend import backend_name, forced_backend, use_backend
from ._shared import GREEDY_TEMPERATURE
from .candidates import *  # noqa: F401,F403
from .confidence import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .recurrent import *  # noqa: F401,F403
from .rng import *  # noqa: F401,F403
from .markov import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
from .tree import *  # noqa: F401,F403
from .verify import *  # noqa: F401,F403
from .workspace import Workspace
