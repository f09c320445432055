"""Triton verify family: verify tokens, proposal lengths, greedy and probabilistic accept (contracts:
``dspark.kernels.verify``).

Greedy accept: a sliced argmax pass over the verify logits (packed greedy keys, NaN as -inf, -0 ==
+0) then one program per batch row merging the slices and walking the drafts. Probabilistic accept:
NVIDIA runs one thread per batch row that walks the whole vocabulary for the residual or bonus draw;
here a first kernel decides the accepted prefix of every row (at most ``P_v`` scalar ratio tests,
vectorised) and describes the single draw the row still needs, and the draw is ``draw.draw_rows``'s
split-row inverse-CDF walk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._shared import next_pow2
from . import draw as tdraw
from ._shared import ELEMENTWISE_BLOCK, ROW_BLOCK_ENTRIES, SIGN32, TINY, claim, greedy_key, merge, orderable
from ._shared import unpack_key

__all__ = ["build_verify_tokens", "fill_proposal_lengths", "greedy_accept", "probabilistic_accept"]


# ----------------------------------------------------------------------------- verify tokens, lengths


@triton.jit
def _build_verify_kernel(last_ptr, draft_ptr, draft_stride, out_ptr, N, VERIFY_LEN, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    b = offs // VERIFY_LEN
    j = offs % VERIFY_LEN
    last = tl.load(last_ptr + b, mask=valid & (j == 0))
    draft = tl.load(draft_ptr + b * draft_stride + j - 1, mask=valid & (j > 0))
    tl.store(out_ptr + offs, tl.where(j == 0, last, draft), mask=valid)


def build_verify_tokens(last_accepted_tokens, draft_token_ids, verify_proposal_len):
    """``dspark.kernels.build_verify_tokens``."""
    batch, draft_stride = draft_token_ids.shape
    verify_len = verify_proposal_len + 1
    out = torch.empty(batch, verify_len, dtype=torch.int32, device=draft_token_ids.device)
    n = batch * verify_len
    _build_verify_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](last_accepted_tokens, draft_token_ids, draft_stride, out,
                                                               n, verify_len, BLOCK=ELEMENTWISE_BLOCK)
    return out


@triton.jit
def _fill_kernel(out_ptr, value, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full([BLOCK], value, tl.int32), mask=offs < N)


def fill_proposal_lengths(batch_size, proposal_len, device):
    """``dspark.kernels.fill_proposal_lengths``."""
    out = torch.empty(batch_size, dtype=torch.int32, device=device)
    if batch_size:
        _fill_kernel[(triton.cdiv(batch_size, ELEMENTWISE_BLOCK),)](out, proposal_len, batch_size,
                                                                     BLOCK=ELEMENTWISE_BLOCK)
    return out


# ----------------------------------------------------------------------------- greedy accept


@triton.jit
def _row_argmax_partial_kernel(logits_ptr, partial_ptr, V, NUM_SPLITS, BLOCK: tl.constexpr):
    """Packed key of the argmax of one ``BLOCK`` slice of one row (NaN as -inf, -0 == +0)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs = split * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(logits_ptr + row * V + offs, mask=valid, other=0.0)
    x = tl.where(x != x, float("-inf"), x)
    image = tl.where(x == 0.0, SIGN32, orderable(x))
    key = tl.max(tl.where(valid, greedy_key(image, offs), 0), axis=0)
    tl.store(partial_ptr.to(tl.pointer_type(tl.uint64)) + row * NUM_SPLITS + split, key)


@triton.jit
def _greedy_accept_kernel(
    partial_ptr, NUM_SPLITS, draft_ptr, draft_stride, lengths_ptr, accepted_ptr, accept_length_ptr,
    VERIFY_PROPOSAL_LEN, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Per batch row: merge the slice keys into the argmax of each verify row, then walk the draft."""
    b = tl.program_id(0)
    verify_len = VERIFY_PROPOSAL_LEN + 1
    pos = tl.arange(0, BLOCK_L)
    splits = tl.arange(0, BLOCK_S)
    in_row = pos < verify_len
    partial = partial_ptr.to(tl.pointer_type(tl.uint64)) + (b * verify_len + pos)[:, None] * NUM_SPLITS + splits[None, :]
    keys = tl.load(partial, mask=in_row[:, None] & (splits < NUM_SPLITS)[None, :], other=0)
    target = unpack_key(tl.max(keys, axis=1))

    row_p = tl.maximum(1, tl.minimum(VERIFY_PROPOSAL_LEN, tl.load(lengths_ptr + b)))
    walked = pos < row_p
    draft = tl.load(draft_ptr + b * draft_stride + pos, mask=walked, other=0)
    mismatch = ~(walked & (draft == target))
    n = tl.min(tl.where(mismatch, pos, BLOCK_L), axis=0)
    accepted = tl.where(pos < n, draft, tl.where(pos == n, target, 0))
    tl.store(accepted_ptr + b * verify_len + pos, accepted, mask=in_row)
    tl.store(accept_length_ptr + b, n + 1)


def greedy_accept_config(vocab: int) -> dict:
    """Slice length and warps of the argmax pass (a plain fp32 stream; tuned on an H200)."""
    return dict(BLOCK=min(2048, next_pow2(vocab)), num_warps=4)


def argmax_plan(rows: int, vocab: int) -> dict:
    """Scratch of ``greedy_accept``: the slices' argmax keys."""
    return {"argmax_partial": (rows * triton.cdiv(vocab, greedy_accept_config(vocab)["BLOCK"]), torch.int64)}


def greedy_accept(base_logits, draft_token_ids, proposal_lengths, verify_proposal_len, workspace):
    """``dspark.kernels.greedy_accept`` in two launches: sliced row argmax, then the walk."""
    batch, draft_stride = draft_token_ids.shape
    rows, vocab = base_logits.shape
    device = base_logits.device
    cfg = greedy_accept_config(vocab)
    splits = triton.cdiv(vocab, cfg["BLOCK"])
    partial = claim(workspace, argmax_plan(rows, vocab), device)["argmax_partial"]
    _row_argmax_partial_kernel[(rows, splits)](base_logits, partial, vocab, splits, **cfg)
    verify_len = verify_proposal_len + 1
    accepted = torch.empty(batch, verify_len, dtype=torch.int32, device=device)
    accept_length = torch.empty(batch, dtype=torch.int32, device=device)
    _greedy_accept_kernel[(batch,)](
        partial, splits, draft_token_ids, draft_stride, proposal_lengths, accepted, accept_length, verify_proposal_len,
        BLOCK_L=next_pow2(verify_len), BLOCK_S=next_pow2(splits),
    )
    return accepted, accept_length


# ----------------------------------------------------------------------------- probabilistic accept


@triton.jit
def _accept_prefix_kernel(target_ptr, draft_probs_ptr, draft_ids_ptr, lengths_ptr, u_ptr, B, V, S, P_V,
                          accepted_ptr, desc_ptr, draw_ptr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Per ``ROWS`` batch rows: the accepted prefix ``n`` (stored, rest of the row zeroed) and the draw
    still due: ``desc[b] = (target row offset, draft row offset or -1)``, ``draw[b] = (uniform bits,
    n)`` -- the residual of position ``n`` after a rejection, else the bonus from target row ``rowP``.
    """
    b = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = b < B
    row_p = tl.maximum(1, tl.minimum(P_V, tl.load(lengths_ptr + b, mask=live, other=1)))[:, None]
    s = tl.arange(0, BLOCK)[None, :]
    walked = live[:, None] & (s < row_p)
    token = tl.load(draft_ids_ptr + b[:, None] * S + s, mask=walked, other=0)
    column = tl.minimum(tl.maximum(token, 0), V - 1).to(tl.int64)  # bad ids never address out of range
    target_rows = (b[:, None] * (P_V + 1) + s).to(tl.int64) * V
    draft_rows = (b[:, None] * S + s).to(tl.int64) * V
    p = tl.load(target_ptr + target_rows + column, mask=walked, other=0.0)
    q = tl.load(draft_probs_ptr + draft_rows + column, mask=walked, other=1.0)
    ratio = p / q
    a = tl.where(q <= TINY, 1.0, tl.where(ratio < 1.0, ratio, 1.0))  # fminf(p/q, 1): NaN -> 1
    u_rows = u_ptr + b.to(tl.int64) * (2 * S + 1)
    accept = (p > 0.0) & (tl.load(u_rows[:, None] + s, mask=walked, other=1.0) <= a)
    n = tl.min(tl.where(walked & ~accept, s, row_p), axis=1)
    tl.store(accepted_ptr + b[:, None] * (P_V + 1) + s, tl.where(s < n[:, None], token, 0),
             mask=live[:, None] & (s < P_V + 1))
    rejected = n < tl.reshape(row_p, [ROWS])
    at_n = s == n[:, None]
    tl.store(desc_ptr + b * 2, tl.sum(tl.where(at_n, target_rows, 0), axis=1), mask=live)
    tl.store(desc_ptr + b * 2 + 1, tl.where(rejected, tl.sum(tl.where(at_n, draft_rows, 0), axis=1), -1), mask=live)
    u = tl.load(u_rows + tl.where(rejected, S + n, 2 * S), mask=live, other=0.0)
    tl.store(draw_ptr + b * 2, u.to(tl.int32, bitcast=True), mask=live)
    tl.store(draw_ptr + b * 2 + 1, n, mask=live)


def accept_plan(batch: int, vocab: int) -> dict:
    """Scratch of ``probabilistic_accept``: each row's draw descriptor, then the draw's."""
    return merge({"accept_desc": (batch * 2, torch.int64), "accept_draw": (batch * 2, torch.int32)},
                 tdraw.plan(batch, vocab))


def probabilistic_accept(target_probabilities, draft_probabilities, draft_token_ids, proposal_lengths, accept_uniforms,
                         verify_proposal_len, workspace):
    """``dspark.kernels.probabilistic_accept``: three launches, no host synchronisation."""
    batch, stride = draft_token_ids.shape
    vocab = target_probabilities.shape[2]
    device = draft_token_ids.device
    accepted = torch.empty(batch, verify_proposal_len + 1, dtype=torch.int32, device=device)
    accept_length = torch.empty(batch, dtype=torch.int32, device=device)
    if not batch:
        return accepted, accept_length
    buf = claim(workspace, accept_plan(batch, vocab), device)
    block = next_pow2(verify_proposal_len + 1)
    rows = max(1, ROW_BLOCK_ENTRIES // (4 * block))  # batch rows per program: ratio tests are tiny
    _accept_prefix_kernel[(triton.cdiv(batch, rows),)](
        target_probabilities, draft_probabilities, draft_token_ids, proposal_lengths, accept_uniforms, batch, vocab,
        stride, verify_proposal_len, accepted, buf["accept_desc"], buf["accept_draw"], ROWS=rows, BLOCK=block,
        num_warps=2)
    tdraw.draw_rows(target_probabilities, batch, vocab, accepted, verify_proposal_len + 1, workspace,
                    q=draft_probabilities, desc=buf["accept_desc"], draw=buf["accept_draw"], lengths=accept_length)
    return accepted, accept_length
