"""Device helpers and launch helpers shared by the Triton families (markov, filter, draw, verify,
confidence).

Backend functions receive the public functions' validated, normalised arguments (see
``dspark.kernels._backend``; the contracts are on the public functions). Token ids read from memory
are clamped into ``[0, V)`` before they address anything: on the GPU nobody checked them.

Two orderable images of fp32 values, as the contracts need:

* greedy keys (kernels.md 3.14): uint32 image ``_orderable`` (+0.0 above -0.0, +NaN above +inf) in
  the high word of a uint64 key whose low word is the complemented index -- NVIDIA's packed argmax;
* filter keys: int32 image ``ord`` (-0.0 equal to +0.0, no NaN) in the high word of an int64 key
  with the complemented index below, ranking equal values by the lower index.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._shared import TINY as _TINY_VALUE
from .._shared import UNIFORM_MAX as _UNIFORM_MAX_VALUE
from .._shared import next_pow2

# Triton 3.6's CPU interpreter multiplies the raw uint16 bits of bf16 operands in tl.dot, so under
# the interpreter dots run on fp32 copies (exact products, same fp32 accumulation).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Entries per program when many small rows share one (the interpreter pays per program, not per entry).
# Loops with a runtime trip count are written as while loops: the interpreter (numpy 2) rejects them.
ROW_BLOCK_ENTRIES = 32768 if INTERPRET else 4096
ELEMENTWISE_BLOCK = 1024

TINY = tl.constexpr(_TINY_VALUE)
UNIFORM_MAX = tl.constexpr(_UNIFORM_MAX_VALUE)
SIGN32 = tl.constexpr(0x80000000)
SENTINEL = tl.constexpr(-(2**63))  # filter key below every real entry's key
MAX_KEY = tl.constexpr(2**63 - 1)
NO_HIT = tl.constexpr(2**31 - 1)  # "no index" for min-reductions
MAX_CANDIDATES = 128  # top-k up to it is selected exactly from the filter's candidates (NVIDIA's parallel limit)
CANDIDATE_LIMIT = tl.constexpr(MAX_CANDIDATES)  # the same, inside kernels


# ------------------------------------------------------------------------------ greedy keys


@triton.jit
def orderable(x):
    """uint32 image of fp32 ``x`` whose unsigned order is the float order (high word of 3.14)."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where(u >= SIGN32, u ^ 0xFFFFFFFF, u | SIGN32)


@triton.jit
def greedy_key(image, index):
    """Packed uint64 key (kernels.md 3.14) of a uint32 orderable image and an int32 vocabulary index.

    The unsigned order of keys is the value order, equal values ranking the lower index higher;
    0 is below every real key, so it is the floor for padding lanes.
    """
    return (image.to(tl.uint64) << 32) | (index.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)


@triton.jit
def unpack_key(key):
    """Token id of a packed greedy key (int64 storage): ``0xFFFFFFFF - low word`` as int32 (0 -> -1)."""
    return key.to(tl.int32) ^ -1


# ------------------------------------------------------------------------------ filter keys


@triton.jit
def ord_image(x):
    """int32 that orders like the fp32 ``x`` (-0.0 and +0.0 map to the same value; x not NaN)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def ord_value(o):
    """fp32 value of an ``ord_image``."""
    return tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)


@triton.jit
def order_key(x, index):
    """int64 key ranking entries by value, then by the LOWER index (the reference's stable order)."""
    return (ord_image(x).to(tl.int64) << 32) | (index.to(tl.int64) ^ 0xFFFFFFFF)


@triton.jit
def key_value(key):
    return ord_value((key >> 32).to(tl.int32))


@triton.jit
def key_index(key):
    return ((key & 0xFFFFFFFF) ^ 0xFFFFFFFF).to(tl.int32)


# ------------------------------------------------------------------------------ math


@triton.jit
def dot(a, b, acc, INTERPRET_: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation (fp32 operands under the interpreter, see ``INTERPRET``)."""
    if INTERPRET_:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def tile_stats(x, AXIS: tl.constexpr):
    """``(max, sum exp(x - max))`` along ``AXIS``; a NaN gives a NaN sum, an all -inf tile ``(-inf, 0)``."""
    m = tl.max(tl.where(x == x, x, float("-inf")), axis=AXIS)
    base = tl.where(m > float("-inf"), m, 0.0)
    return m, tl.sum(tl.exp(x - tl.expand_dims(base, AXIS)), axis=AXIS)


@triton.jit
def is_degenerate(total):
    """Softmax normalisers that are not finite and positive: the row is uniform ``1/V``."""
    return (total != total) | (total <= 0.0) | (total == float("inf"))


@triton.jit
def row_filter(row, inv_temp, top_k, top_p, settings_ptr, PER_ROW: tl.constexpr):
    """Row ``row``'s ``(inv_temp, top_k, top_p)``. ``PER_ROW`` 0: the launch's scalars; 1: row ``row``
    of the f32 ``[rows, 3]`` settings ``(inv_temp, k, p)`` (``dspark.kernels._shared.row_filter_settings``);
    2: its k and p with the launch's scalar inv_temp (the logits were scaled already)."""
    # tensors either way: Triton folds an int argument of 1 into a constexpr, where ~ is not a logical not
    inv_temp = inv_temp + tl.zeros([], tl.float32)
    top_k = top_k + tl.zeros([], tl.int32)
    top_p = top_p + tl.zeros([], tl.float32)
    if PER_ROW > 0:
        base = settings_ptr + row.to(tl.int64) * 3
        top_k = tl.load(base + 1).to(tl.int32)
        top_p = tl.load(base + 2)
        if PER_ROW == 1:
            inv_temp = tl.load(base)
    return inv_temp, top_k, top_p


@triton.jit
def row_inv_temp(row, inv_temp, settings_ptr, PER_ROW: tl.constexpr):
    """Row ``row``'s inverse temperature (``row_filter``'s first value)."""
    if PER_ROW == 1:
        inv_temp = tl.load(settings_ptr + row.to(tl.int64) * 3)
    return inv_temp


@triton.jit
def clamp_uniform(u):
    """NVIDIA's ``clampUniform``: ``min(max(u, 0), 1 - 2^-24)``, NaN -> 0 as fmaxf does."""
    return tl.minimum(tl.where(u > 0.0, u, 0.0), UNIFORM_MAX)


@triton.jit
def positive(w):
    """The inverse-CDF walk's weights: entries that are not > 0 (incl. NaN) add nothing."""
    return tl.where(w > 0.0, w, 0.0)


@triton.jit
def first_hit(w, index, carry, t):
    """First ``index`` whose running sum ``carry + cumsum(w)`` exceeds ``t`` (w > 0), else ``NO_HIT``."""
    hit = (w > 0.0) & (carry + tl.cumsum(w, axis=0) > t)
    return tl.min(tl.where(hit, index, NO_HIT), axis=0)


# ------------------------------------------------------------------------------ host helpers


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the CPU interpreter, to exercise the loops)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_chunk(vocab: int, cap: int = 4096) -> int:
    """Entries of a row handled by one program: ``cap`` on real vocabularies, smaller for small ones
    so that every row still spans several chunks."""
    return min(cap, max(16, next_pow2(triton.cdiv(vocab, 8))))


def claim(workspace, plan: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The scratch buffers of a plan ``{name: (numel, dtype)}`` from ``workspace`` (a ``K.Workspace``)."""
    return {name: workspace.buffer(name, numel, dtype, device) for name, (numel, dtype) in plan.items()}


def merge(*plans: dict) -> dict:
    """One plan needing every buffer of ``plans``, each as large as its largest use."""
    out: dict = {}
    for plan in plans:
        for name, (numel, dtype) in plan.items():
            out[name] = (max(numel, out.get(name, (0, dtype))[0]), dtype)
    return out
