"""Reference tests of the verify family: verify tokens, greedy accept, proposal lengths."""

import math

import pytest
import torch
from kernel_cases import greedy_accept_case

import dspark.kernels as K


@pytest.fixture(autouse=True)
def _reference_backend():
    with K.use_backend("reference"):
        yield


def ids(*rows):
    return torch.tensor(rows, dtype=torch.int32)


def loop_argmax(row: list[float]) -> int:
    """kernels.md 2.5 written plainly: strict > keeps the lower index, NaN never wins, none -> 0."""
    best, best_value = -1, -math.inf
    for i, x in enumerate(row):
        if x > best_value:  # NaN compares false
            best, best_value = i, x
    return max(best, 0)


def loop_greedy_accept(base_logits, draft, lengths, p_v):
    """kernels.md 3.3 written plainly, with dspark's zeroing past accept_length."""
    batch = draft.shape[0]
    rows = base_logits.reshape(batch, p_v + 1, -1).tolist()
    accepted, accept_length = [], []
    for b in range(batch):
        argmax = [loop_argmax(r) for r in rows[b]]
        row_p = max(1, min(p_v, int(lengths[b])))
        n = 0
        while n < row_p and argmax[n] == int(draft[b, n]):
            n += 1
        accepted.append(argmax[: n + 1] + [0] * (p_v - n))
        accept_length.append(n + 1)
    return accepted, accept_length


# ------------------------------------------------------------------------------ build_verify_tokens


def test_nvidia_vector_12_build_verify_tokens_uses_draft_stride():
    out = K.build_verify_tokens(ids(5), ids([7, 8, 9]), 1)
    assert out.dtype == torch.int32 and out.tolist() == [[5, 7]]


def test_build_verify_tokens_full_and_partial_windows():
    last = ids(1, 2)
    draft = ids([10, 11, 12, 13], [20, 21, 22, 23])
    assert K.build_verify_tokens(last, draft, 4).tolist() == [[1, 10, 11, 12, 13], [2, 20, 21, 22, 23]]
    assert K.build_verify_tokens(last, draft[:, ::2], 2).tolist() == [[1, 10, 12], [2, 20, 22]]  # any layout in


def test_build_verify_tokens_bad_input():
    draft = ids([7, 8, 9])
    with pytest.raises(ValueError, match="verify_proposal_len.*draft stride S = 3"):
        K.build_verify_tokens(ids(5), draft, 4)
    with pytest.raises(ValueError, match="verify_proposal_len"):
        K.build_verify_tokens(ids(5), draft, 0)
    with pytest.raises(TypeError, match="last_accepted_tokens"):
        K.build_verify_tokens(torch.tensor([5]), draft, 1)
    with pytest.raises(ValueError, match="last_accepted_tokens"):
        K.build_verify_tokens(ids(5, 6), draft, 1)
    with pytest.raises(ValueError, match="draft_token_ids"):
        K.build_verify_tokens(ids(5), ids(7, 8, 9), 1)


# ------------------------------------------------------------------------------ greedy_accept


def test_greedy_accept_hand_example():
    # verify tokens [last, 1, 2, 3]; the base predicts 1, 2, 0, 3: two accepted, then correction 0.
    logits = torch.full((1, 4, 5), -1.0)
    for i, t in enumerate([1, 2, 0, 3]):
        logits[0, i, t] = 1.0
    accepted, length = K.greedy_accept(logits, ids([1, 2, 3]), ids(3), 3)
    assert accepted.dtype == torch.int32 and length.dtype == torch.int32
    assert accepted.tolist() == [[1, 2, 0, 0]] and length.tolist() == [3]
    accepted, length = K.greedy_accept(logits, ids([1, 2, 0]), ids(3), 3)  # all accepted: bonus 3
    assert accepted.tolist() == [[1, 2, 0, 3]] and length.tolist() == [4]
    accepted, length = K.greedy_accept(logits, ids([1, 2, 0]), ids(1), 3)  # rowP 1: bonus from row 1
    assert accepted.tolist() == [[1, 2, 0, 0]] and length.tolist() == [2]


def test_greedy_accept_proposal_length_zero_still_walks_one():
    logits = torch.zeros(2, 3, 4)
    logits[:, 0, 2] = 1.0
    logits[:, 1, 3] = 1.0
    accepted, length = K.greedy_accept(logits, ids([2, 1], [1, 1]), ids(0, -4), 2)  # rowP = max(1, ...)
    assert accepted.tolist() == [[2, 3, 0], [2, 0, 0]] and length.tolist() == [2, 1]


def test_greedy_accept_ties_nan_and_infinities():
    inf, nan = math.inf, math.nan
    logits = torch.tensor([[[nan, 3.0, 5.0, 5.0], [-inf, -inf, -inf, -inf]],
                           [[nan, nan, nan, nan], [0.0, -0.0, inf, inf]]])
    accepted, length = K.greedy_accept(logits, ids([2], [0]), ids(1, 1), 1)
    assert accepted.tolist() == [[2, 0], [0, 2]] and length.tolist() == [2, 2]


@pytest.mark.parametrize("batch,stride,p_v,vocab,flat", [
    (1, 1, 1, 131, False),
    (3, 4, 4, 1000, True),
    (8, 7, 3, 4099, False),  # verify_proposal_len < draft stride
    (8, 7, 7, 5, True),
])
def test_greedy_accept_matches_plain_loop(batch, stride, p_v, vocab, flat):
    case = greedy_accept_case(batch, stride, p_v, vocab, flat=flat, seed=batch + vocab)
    accepted, length = K.greedy_accept(*case.args())
    expect_accepted, expect_length = loop_greedy_accept(*case.args())
    assert accepted.tolist() == expect_accepted
    assert length.tolist() == expect_length
    assert accepted.shape == (batch, p_v + 1)


def test_greedy_accept_case_covers_every_branch():
    lengths, full, rejected = set(), 0, 0
    for seed in range(4):
        case = greedy_accept_case(8, 5, 4, 50, seed=seed)
        _, length = K.greedy_accept(*case.args())
        row_p = case.proposal_lengths.clamp(1, 4)
        full += int((length == row_p + 1).sum())
        rejected += int((length <= row_p).sum())
        lengths.update(case.proposal_lengths.tolist())
    assert full > 0 and rejected > 0 and {0, 5, 6} <= lengths


def test_greedy_accept_bad_input():
    logits = torch.zeros(2, 3, 10)
    draft = ids([1, 2, 3], [4, 5, 6])
    with pytest.raises(ValueError, match="verify_proposal_len.*draft stride"):
        K.greedy_accept(logits, draft, ids(2, 2), 4)
    with pytest.raises(ValueError, match="base_logits"):
        K.greedy_accept(logits, draft, ids(2, 2), 3)  # needs 4 rows per entry
    with pytest.raises(TypeError, match="base_logits"):
        K.greedy_accept(logits.half(), draft, ids(2, 2), 2)
    with pytest.raises(ValueError, match="proposal_lengths"):
        K.greedy_accept(logits, draft, ids(2), 2)
    with pytest.raises(TypeError, match="proposal_lengths"):
        K.greedy_accept(logits, draft, torch.tensor([2, 2]), 2)
    with pytest.raises(ValueError, match=r"draft_token_ids\[:, :2\].*10"):
        K.greedy_accept(logits, ids([1, 10, 3], [4, 5, 6]), ids(2, 2), 2)
    K.greedy_accept(logits, ids([1, 2, 10], [4, 5, 6]), ids(2, 2), 2)  # past P_v: never read, not checked


# ------------------------------------------------------------------------------ fill_proposal_lengths


def test_fill_proposal_lengths():
    out = K.fill_proposal_lengths(3, 7)
    assert out.dtype == torch.int32 and out.device.type == "cpu" and out.tolist() == [7, 7, 7]
    assert K.fill_proposal_lengths(2, 0, device=torch.device("cpu")).tolist() == [0, 0]
    assert K.fill_proposal_lengths(0, 4).shape == (0,)
    with pytest.raises(ValueError, match="batch_size"):
        K.fill_proposal_lengths(-1, 4)
    with pytest.raises(TypeError, match="proposal_len"):
        K.fill_proposal_lengths(2, 4.0)
    with pytest.raises(TypeError, match="device"):
        K.fill_proposal_lengths(2, 4, device="nowhere")
