"""Verify family: verify tokens, greedy and probabilistic accept, proposal lengths, value checks.

Reference tests against plain loops, NVIDIA's vectors and the spec's pseudocode
(``sampling_cases``), then the Triton backend against the reference (on the CPU under
``TRITON_INTERPRET=1``). Greedy accept compares bit for bit (ties and NaN included); probabilistic
accept compares accept lengths and accepted prefixes exactly and the one drawn token by the boundary
rule of ``sampling_cases.assert_tokens_agree``.
"""

import math

import pytest
import torch
from conftest import BACKEND_PARAMS, DEVICE, INTERPRETER_WARNINGS, assert_same, gpu, on_backends, requires_triton
from kernel_cases import greedy_accept_case

import dspark.kernels as K
import sampling_cases as cases

pytestmark = [pytest.mark.usefixtures("reference_backend"), INTERPRETER_WARNINGS]
I32 = torch.int32


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


def test_greedy_accept_ties_nan_and_infinities(unchecked_values):
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
def test_greedy_accept_matches_plain_loop(unchecked_values, batch, stride, p_v, vocab, flat):
    case = greedy_accept_case(batch, stride, p_v, vocab, flat=flat, seed=batch + vocab)
    accepted, length = K.greedy_accept(*case.args())
    expect_accepted, expect_length = loop_greedy_accept(*case.args())
    assert accepted.tolist() == expect_accepted
    assert length.tolist() == expect_length
    assert accepted.shape == (batch, p_v + 1)


def test_greedy_accept_case_covers_every_branch(unchecked_values):
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


# ------------------------------------------------------------------------------ probabilistic_accept


def f32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.float32, device=device)


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=I32, device=device)


def raises(exc, *words):
    """pytest.raises whose message must name the function's argument(s)."""
    return pytest.raises(exc, match=".*".join(words))


ACCEPT_VECTORS = [  # target [P_v+1, V], draft [S, V], drafts, uniforms [2S+1], P_v, lengths, (accepted, accept_length)
    ([[.1, .8, .05, .05], [.5, .2, .1, .2], [.25] * 4], [[.2, .4, .2, .2], [.2, .3, .5, 0]], [1, 2],
     [0.5, 0.9, 0.0, 0.7, 0.0], 2, [2], ([1, 3, 0], 2)),  # NVIDIA test 7: residual on a rejection
    ([[.1, .8, .05, .05], [.1, .2, .6, .1], [.1, .2, .3, .4]], [[.1, .4, .4, .1], [.2, .2, .2, .4]], [1, 2],
     [.9, .9, 0, 0, .75], 2, [2], ([1, 2, 3], 3)),  # NVIDIA test 8: bonus after full acceptance
    ([[.1, .8, .05, .05], [.1, .2, .3, .4]], [[.1, .4, .4, .1], [.25] * 4], [1, 2], [0.9, 0, 0, 0, 0.75], 1, [1],
     ([1, 3], 2)),  # NVIDIA test 13: dynamic verify length
    ([[.7, .3, 0, 0], [.6, .4, 0, 0]], [[.2, .8, 0, 0]], [2], [0.0, 0.5, 0.5], 1, [1],
     ([0, 0], 1)),  # NVIDIA test 16: a token the target gives no mass is rejected
    ([[.5, .5, 0], [0, 0, 1]], [[1, 0, 0]], [1], [0.99999994, 0, 0.3], 1, [1], ([1, 2], 2)),  # q = 0: accept
    ([[.5, .5, 0], [1, 0, 0]], [[.5, .5, 0]], [2], [0.0, 0.6, 0.0], 1, [1], ([1, 0], 1)),  # p == q: draw from p
    ([[0, 1, 0], [0, 0, 1]], [[0, 1, 0]], [1], [0.99999994, 0.5, 0.5], 1, [1], ([1, 2], 2)),  # one-hot rows
    ([[0, 1, 0], [0, 0, 1], [1, 0, 0]], [[0, 1, 0], [0, 0, 1]], [1, 2], [0.5, 0.5, 0, 0, 0.5], 2, [0],
     ([1, 2, 0], 2)),  # proposal length 0 walks one draft
    ([[0, 1, 0], [0, 0, 1], [1, 0, 0]], [[0, 1, 0], [0, 0, 1]], [1, 2], [0.5, 0.5, 0, 0, 0.5], 2, [9],
     ([1, 2, 0], 3)),  # a length beyond P_v walks P_v
    ([[0, 1, 0], [0, 0, 1]], [[0, 1, 0], [0, 0, 1]], [1, 2], [0.5, 0.5, 0, 0, 0.5], 1, [9], ([1, 2], 2)),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("target, draft, tokens, u, p_v, lengths, expected", ACCEPT_VECTORS)
def test_probabilistic_accept_vectors(backend, target, draft, tokens, u, p_v, lengths, expected):
    with K.use_backend(backend):
        accepted, length = K.probabilistic_accept(f32([target], DEVICE), f32([draft], DEVICE), i32([tokens], DEVICE),
                                                  i32(lengths, DEVICE), f32([u], DEVICE), p_v)
    assert (accepted[0].tolist(), int(length[0])) == expected


@pytest.mark.parametrize("stride, verify_proposal_len, vocab", [(1, 1, 8), (4, 4, 16), (4, 2, 16), (3, 3, 1000)])
def test_probabilistic_accept_matches_spec_pseudocode(stride, verify_proposal_len, vocab):
    case = cases.accept_inputs(64, stride, verify_proposal_len, vocab, seed=stride * 10 + verify_proposal_len)
    accepted, lengths = K.probabilistic_accept(**case)
    expected, expected_lengths = cases.probabilistic_accept(
        case["target_probabilities"].numpy(), case["draft_probabilities"].numpy(), case["draft_token_ids"].numpy(),
        case["proposal_lengths"].numpy(), case["accept_uniforms"].numpy(), verify_proposal_len)
    assert accepted.dtype == I32 and lengths.dtype == I32
    assert accepted.tolist() == expected.tolist() and lengths.tolist() == expected_lengths.tolist()
    assert len(set(lengths.tolist())) > 1  # both accepts and rejections happened


def test_probabilistic_accept_rejects_bad_input():
    case = cases.accept_inputs(2, 3, 2, 6)

    def run(**changes):
        K.probabilistic_accept(**{**case, **changes})

    with raises(ValueError, "probabilistic_accept", "verify_proposal_len"):
        run(verify_proposal_len=4)
    with raises(ValueError, "probabilistic_accept", "accept_uniforms", r"\[2, 7\]"):
        run(accept_uniforms=torch.rand(2, 6))
    with raises(ValueError, "probabilistic_accept", "target_probabilities"):
        run(target_probabilities=torch.rand(2, 4, 6))
    with raises(ValueError, "probabilistic_accept", "draft_token_ids", "6"):
        run(draft_token_ids=i32([[6, 0, 0], [0, 0, 0]]))
    with raises(TypeError, "probabilistic_accept", "proposal_lengths"):
        run(proposal_lengths=case["proposal_lengths"].long())
    with raises(ValueError, "probabilistic_accept", "draft_probabilities"):
        run(draft_probabilities=torch.rand(2, 3, 7))


# ------------------------------------------------------------------------------ value checks


def test_greedy_accept_rejects_nan_logits():
    logits = torch.zeros(1, 2, 10)
    logits[0, 1, 3] = float("nan")
    with raises(ValueError, "greedy_accept", "base_logits", "NaN", r"\[1, 3\]"):
        K.greedy_accept(logits, ids([1]), ids(1), 1)


@pytest.mark.parametrize("change, words", [
    (lambda t, d: t.__setitem__((0, 1, 2), float("nan")), ("target_probabilities", "finite")),
    (lambda t, d: t.__setitem__((1, 0, 0), -0.25), ("target_probabilities", "-0.25")),
    (lambda t, d: t.mul_(2.0), ("target_probabilities", "sum to 1", "sums to 2")),
    (lambda t, d: d.__setitem__((0, 1, 4), float("inf")), (r"draft_probabilities\[:, :2\]", "finite")),
    (lambda t, d: d[1, 0, :1].add_(0.01), (r"draft_probabilities\[:, :2\]", r"row \[1, 0\] sums to 1.01")),
])
def test_probabilistic_accept_rejects_rows_that_are_not_probabilities(change, words):
    case = cases.accept_inputs(2, 3, 2, 6)
    change(case["target_probabilities"], case["draft_probabilities"])
    with raises(ValueError, "probabilistic_accept", *words):
        K.probabilistic_accept(**case)


def test_probabilistic_accept_checks_only_the_rows_it_reads():
    case = cases.accept_inputs(2, 3, 2, 6)
    case["draft_probabilities"][:, 2] = float("nan")  # draft row 2 >= P_v: never read
    expected = K.probabilistic_accept(**{**case, "draft_probabilities": case["draft_probabilities"].nan_to_num()})
    assert all(torch.equal(a, b) for a, b in zip(K.probabilistic_accept(**case), expected))


def test_value_checks_can_be_switched_off_and_must_be_0_or_1(monkeypatch):
    case = cases.accept_inputs(2, 3, 2, 6)
    case["target_probabilities"].mul_(3.0)
    monkeypatch.setenv("DSPARK_CHECK_VALUES", "0")
    K.probabilistic_accept(**case)  # the kernel's own behaviour: no check
    monkeypatch.setenv("DSPARK_CHECK_VALUES", "yes")
    with pytest.raises(ValueError, match="DSPARK_CHECK_VALUES must be 0 or 1"):
        K.probabilistic_accept(**case)


def test_value_checks_on_other_devices_are_opt_in(monkeypatch):
    """A CUDA check would sync the host: off unless DSPARK_CHECK_VALUES=1 (meta tensors stand in here)."""
    from dspark.kernels._validate import check_values

    off_cpu = torch.empty(3, device="meta")
    monkeypatch.delenv("DSPARK_CHECK_VALUES", raising=False)
    assert check_values(torch.zeros(3)) and not check_values(off_cpu)
    monkeypatch.setenv("DSPARK_CHECK_VALUES", "1")
    assert check_values(off_cpu) and not check_values(torch.zeros(0))


# ------------------------------------------------------------------------------ Triton backend


@requires_triton
def test_build_verify_tokens_and_fill_proposal_lengths_match_reference():
    last = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    draft = torch.tensor([[7, 8, 9]], dtype=torch.int32, device=DEVICE)
    with K.use_backend("triton"):
        assert K.build_verify_tokens(last, draft, 1).tolist() == [[5, 7]]  # NVIDIA vector 12
    last = torch.randint(0, 1000, (5,), dtype=torch.int32, device=DEVICE)
    draft = torch.randint(0, 1000, (5, 7), dtype=torch.int32, device=DEVICE)
    for p_v in (1, 4, 7):
        assert_same(*on_backends(lambda: K.build_verify_tokens(last, draft, p_v)))
    for batch, length in ((0, 3), (1, 7), (1500, 4)):
        assert_same(*on_backends(lambda: K.fill_proposal_lengths(batch, length, device=DEVICE)))


@requires_triton
@pytest.mark.parametrize("batch, stride, p_v, vocab, flat", [
    (1, 1, 1, 131, False),
    (3, 4, 3, 1000, True),
    (8, 7, 7, 1000, False),
    (4, 7, 4, 4099, True),  # two argmax slices with a 3-entry tail
])
def test_greedy_accept_matches_reference(unchecked_values, batch, stride, p_v, vocab, flat):
    case = greedy_accept_case(batch, stride, p_v, vocab, flat=flat, device=DEVICE, seed=batch)
    expected, actual = on_backends(lambda: K.greedy_accept(*case.args()))
    assert_same(expected, actual)


@requires_triton
def test_greedy_accept_ties_across_slices_go_to_the_lowest_index(unchecked_values):
    vocab = 4099
    logits = torch.full((3, vocab), -1.0)
    logits[0, 4097] = logits[0, 5] = 3.0  # tie across the two slices
    logits[1, 4098] = 3.0  # max in the tail of the last slice
    logits[2] = float("-inf")
    logits[2, 4096] = float("nan")  # NaN never wins; all -inf gives 0
    with K.use_backend("triton"):
        drafts = torch.tensor([[5, 4098]], dtype=torch.int32, device=DEVICE)
        accepted, length = K.greedy_accept(logits.to(DEVICE), drafts, torch.tensor([2], dtype=torch.int32, device=DEVICE), 2)
    assert accepted.tolist() == [[5, 4098, 0]] and length.tolist() == [3]


def drawn_rows(case, lengths):
    """Per batch row, the walk that drew the last emitted token: ``(weights [B, V], u [B], scaled [B])``
    -- the residual ``max(p - q, 0)`` with threshold ``u * total`` after a rejection (plain p when that
    has no mass), else the bonus row of the target."""
    target, draft = case["target_probabilities"].cpu(), case["draft_probabilities"].cpu()
    u, stride = case["accept_uniforms"].cpu(), case["draft_token_ids"].shape[1]
    weights, thresholds, scaled = [], [], []
    for b, n in enumerate((lengths.cpu() - 1).tolist()):
        row_p = max(1, min(case["verify_proposal_len"], int(case["proposal_lengths"][b])))
        if n < row_p:
            residual = (target[b, n] - draft[b, n]).clamp_min(0)
            has_mass = bool(cases.R._sequential_prefix(cases.R._positive(residual[None]))[0, -1] > 1e-20)
            weights.append(residual if has_mass else target[b, n])
            thresholds.append(u[b, stride + n])
            scaled.append(has_mass)
        else:
            weights.append(target[b, row_p])
            thresholds.append(u[b, 2 * stride])
            scaled.append(False)
    return torch.stack(weights), torch.stack(thresholds), torch.tensor(scaled)


@requires_triton
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("stride, p_v, vocab", [(1, 1, 1000), (4, 4, 4099), (7, 5, 1000), (4, 2, 4099)])
def test_probabilistic_accept_matches_reference(batch, stride, p_v, vocab):
    case = cases.accept_inputs(batch, stride, p_v, vocab, seed=batch * 31 + stride, device=DEVICE)
    (ref_ids, ref_len), (tri_ids, tri_len) = on_backends(lambda: K.probabilistic_accept(**case))
    assert torch.equal(ref_len, tri_len)
    last = (tri_len - 1).long()[:, None]
    keep = torch.arange(p_v + 1, device=DEVICE)[None, :] != last
    assert torch.equal(ref_ids[keep], tri_ids[keep])  # the accepted prefix and the zeroed tail
    cases.assert_tokens_agree(ref_ids.gather(1, last)[:, 0], tri_ids.gather(1, last)[:, 0], *drawn_rows(case, tri_len))


@requires_triton
def test_probabilistic_accept_clamps_bad_token_ids():
    """On the GPU ids are not validated (no host sync): the kernel clamps them before addressing."""
    from dspark.kernels.triton import verify as tverify

    vocab = 1000
    target = cases.random_distributions((2, 2), vocab, seed=5, device=DEVICE)
    draft = cases.random_distributions((2, 1), vocab, seed=6, device=DEVICE)
    accepted, length = tverify.probabilistic_accept(target, draft, i32([[vocab + 3], [-9]], DEVICE), i32([1, 1], DEVICE),
                                                    torch.zeros(2, 3, device=DEVICE), 1, K.Workspace())
    assert length.tolist() in ([1, 1], [2, 1], [1, 2], [2, 2])
    assert bool(((accepted[:, -1] >= 0) & (accepted[:, -1] < vocab)).all())


# ------------------------------------------------------------------------------ GPU: real sizes


@requires_triton
@gpu
def test_real_size_greedy_accept_matches_reference(unchecked_values):
    case = greedy_accept_case(64, 7, 7, 151936, device=DEVICE)
    assert_same(*on_backends(lambda: K.greedy_accept(*case.args())))


@requires_triton
@gpu
def test_real_size_accept_and_draws_match_reference():
    case = cases.accept_inputs(16, 7, 7, 151936, device=DEVICE)
    (ref_ids, ref_len), (tri_ids, tri_len) = on_backends(lambda: K.probabilistic_accept(**case))
    assert torch.equal(ref_len, tri_len)
    last = (tri_len - 1).long()[:, None]
    cases.assert_tokens_agree(ref_ids.gather(1, last)[:, 0], tri_ids.gather(1, last)[:, 0], *drawn_rows(case, tri_len))
