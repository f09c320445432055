"""Triton probabilistic accept (kernels.md 3.23): speculative-sampling verification without serial scans.

NVIDIA runs one thread per batch row that walks the whole vocabulary for the residual or bonus draw.
Here a first kernel decides the accepted prefix of every row (at most ``P_v`` scalar ratio tests,
vectorised) and describes the single draw the row still needs; the draw itself is the split-row
inverse-CDF walk of ``dspark.kernels.triton.sampling.draw_rows`` (chunk masses over the whole
vocabulary in parallel, then a block ``cumsum`` in the one chunk the threshold falls into).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling import _TINY, ROW_BLOCK_ENTRIES, _pow2, _workspace, draw_rows

__all__ = ["probabilistic_accept"]


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
    a = tl.where(q <= _TINY, 1.0, tl.where(ratio < 1.0, ratio, 1.0))  # fminf(p/q, 1): NaN -> 1
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


def probabilistic_accept(target_probabilities, draft_probabilities, draft_token_ids, proposal_lengths, accept_uniforms,
                         verify_proposal_len):
    """``(accepted int32 [B, P_v+1], accept_length int32 [B])`` of kernels.md 3.23.

    ``target_probabilities`` f32 ``[B, P_v+1, V]``, ``draft_probabilities`` f32 ``[B, S, V]``,
    ``draft_token_ids`` int32 ``[B, S]``, ``proposal_lengths`` int32 ``[B]``, ``accept_uniforms`` f32
    ``[B, 2S+1]``, all contiguous. Three launches, no host synchronisation.
    """
    batch, stride = draft_token_ids.shape
    vocab = target_probabilities.shape[2]
    device = draft_token_ids.device
    accepted = torch.empty(batch, verify_proposal_len + 1, dtype=torch.int32, device=device)
    accept_length = torch.empty(batch, dtype=torch.int32, device=device)
    if not batch:
        return accepted, accept_length
    desc = _workspace("accept_desc", batch * 2, torch.int64, device)
    draw = _workspace("accept_draw", batch * 2, torch.int32, device)
    block = _pow2(verify_proposal_len + 1)
    rows = max(1, ROW_BLOCK_ENTRIES // (4 * block))  # batch rows per program: ratio tests are tiny
    _accept_prefix_kernel[(triton.cdiv(batch, rows),)](
        target_probabilities, draft_probabilities, draft_token_ids, proposal_lengths, accept_uniforms, batch, vocab,
        stride, verify_proposal_len, accepted, desc, draw, ROWS=rows, BLOCK=block,
        num_warps=2)
    draw_rows(target_probabilities, batch, vocab, accepted, verify_proposal_len + 1, q=draft_probabilities,
              desc=desc, draw=draw, lengths=accept_length)
    return accepted, accept_length
