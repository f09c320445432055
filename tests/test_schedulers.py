"""Batch prefix scheduler (paper Algorithm 1), SPS cost tables, and the Appendix-A losslessness case."""

import json

import pytest
import torch
from scipy import stats as scipy_stats

import dspark.kernels as K
from dspark.engine import SPSCostTable, prefix_schedule, prefix_survival

# ------------------------------------------------------------------------------------ cost tables


def test_cost_table_interpolates_and_extrapolates_linearly():
    table = SPSCostTable((2, 4, 8), (10.0, 14.0, 16.0), fixed_overhead_ms=1.0)
    assert table.step_time(2) == pytest.approx(11.0)
    assert table.step_time(3) == pytest.approx(13.0)  # halfway 10 -> 14, + overhead
    assert table.step_time(6) == pytest.approx(16.0)  # halfway 14 -> 16, + overhead
    assert table.step_time(1) == pytest.approx(9.0)  # first segment's slope continued
    assert table.step_time(10) == pytest.approx(18.0)  # last segment's slope continued
    assert table.sps(3) == pytest.approx(1000.0 / 13.0)
    assert SPSCostTable((4,), (5.0,)).step_time(100) == pytest.approx(5.0)


def test_cost_table_reads_tensorrt_llm_json(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"token_counts": [1, 8], "step_time_ms": [2.0, 9.0], "fixed_overhead_ms": 0.5}))
    table = SPSCostTable.from_json(str(path))
    assert table.token_counts == (1, 8) and table.step_time(4) == pytest.approx(5.5)
    path.write_text(json.dumps({"token_counts": [1, 8]}))
    with pytest.raises(ValueError, match="step_time_ms"):
        SPSCostTable.from_json(str(path))


def test_cost_table_draft_pass_curve(tmp_path):
    table = SPSCostTable((1, 64), (2.0, 4.0), draft_rows=(1, 8, 64), draft_time_ms=(1.0, 1.5, 3.0))
    assert table.draft_time(1) == pytest.approx(1.0) and table.draft_time(36) == pytest.approx(2.25)
    assert table.draft_time(128) == pytest.approx(3.0 + 64 * 1.5 / 56)  # the last segment continued
    assert SPSCostTable((1,), (1.0,)).draft_time(8) == 0.0  # no curve: no draft cost
    path = tmp_path / "cost.json"
    table.write_json(path, device="cpu")
    assert SPSCostTable.from_json(str(path)) == table
    with pytest.raises(ValueError, match="draft_rows must be strictly increasing"):
        SPSCostTable((1,), (1.0,), draft_rows=(4, 2), draft_time_ms=(1.0, 1.0))
    with pytest.raises(ValueError, match="as long as draft_time_ms"):
        SPSCostTable((1,), (1.0,), draft_rows=(4,), draft_time_ms=())


def test_cost_table_prices_rows_apart_from_tokens(tmp_path):
    """The decode curve (R rows of one token) beside the verify curve (rows of ``tokens_per_row``):
    a plain round costs the decode curve's time, a full verify the verify curve's, and a round in
    between the verify curve plus each row it has beyond the curve's own at the per-row excess."""
    table = SPSCostTable((1, 256, 2048), (5.0, 7.0, 21.0), decode_rows=(1, 256), decode_time_ms=(5.0, 14.0),
                         tokens_per_row=8)
    assert table.forward_time(256, 256) == pytest.approx(14.0)  # plain: the decode curve
    assert table.forward_time(2048, 256) == pytest.approx(21.0)  # every row 8 tokens: the verify curve
    row = 7.0 / (256 * 7 / 8)  # the excess at 256 rows over the 224 rows the verify curve lacks
    assert table.row_time(256) == pytest.approx(row)
    assert table.forward_time(512, 256) == pytest.approx(table.step_time(512) + row * (256 - 64))
    assert table.forward_time(512, 256, prefill_tokens=100) == pytest.approx(table.step_time(612) + row * 192)
    tokens = torch.tensor([256, 300, 2048, 4096]).numpy()
    assert table.forward_times(tokens, 256).tolist() == pytest.approx([table.forward_time(int(n), 256) for n in tokens])
    assert table.forward_time(4096, 256) == pytest.approx(table.step_time(4096))  # beyond 8 a row: no row term
    plain = SPSCostTable((1, 256, 2048), (5.0, 7.0, 21.0))  # no decode curve: the verify curve alone
    assert plain.forward_time(256, 256) == plain.step_time(256) and plain.row_time(256) == 0.0
    faster = SPSCostTable((1, 256), (5.0, 7.0), decode_rows=(256,), decode_time_ms=(6.0,))
    assert faster.row_time(256) == 0.0  # a decode curve below the verify curve adds nothing
    path = tmp_path / "cost.json"
    table.write_json(path, device="cpu")
    assert SPSCostTable.from_json(str(path)) == table
    with pytest.raises(ValueError, match="decode_rows must be strictly increasing"):
        SPSCostTable((1,), (1.0,), decode_rows=(4, 2), decode_time_ms=(1.0, 1.0))
    with pytest.raises(ValueError, match="tokens_per_row"):
        SPSCostTable((1,), (1.0,), tokens_per_row=0)


def test_plain_rounds_priced_by_the_decode_curve_let_drafting_pay_at_many_rows():
    """Session 27's H100 at 256 rows: the verify curve priced a plain round at 8.85 ms where it took
    15.4, so plain decoding looked 1.7x as fast as it is and the scheduler decoded plainly where
    verifying a few drafts a row made more tokens a millisecond. With the decode curve, the same
    confidences draft."""
    import numpy as np

    from dspark.engine.schedulers import batch_schedule, drafting_pays

    verify = dict(token_counts=(1, 256, 512, 1024, 2048), step_time_ms=(5.5, 8.85, 11.0, 15.0, 24.0),
                  draft_rows=(1, 256), draft_time_ms=(0.6, 1.2))
    conf = np.tile([0.3, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1], (256, 1))
    blind = SPSCostTable(**verify)
    seeing = SPSCostTable(**verify, decode_rows=(1, 256), decode_time_ms=(5.5, 15.4), tokens_per_row=8)
    assert not drafting_pays(conf, blind, 0.04, (2.0, 1.5))
    assert drafting_pays(conf, seeing, 0.04, (2.0, 1.5))
    # a trimmed round, and a longer one: a row's extra verify tokens cost less than its K/V reads
    assert sum(batch_schedule(conf, blind, 0.04, 2.0)) == 256 < sum(batch_schedule(conf, seeing, 0.04, 2.0)) < 7 * 256


def test_the_draft_pass_makes_verifying_more_pay():
    """A round's draft pass costs the same whatever it verifies, so with it in the step time one more
    token's share of the step is smaller and Algorithm 1 admits drafts it stopped at before."""
    from dspark.engine.schedulers import batch_schedule

    confidences = torch.tensor([[0.9, 0.6, 0.5, 0.5]] * 2).numpy()
    verify_only = SPSCostTable((2, 10), (2.0, 10.0))  # 1 ms a token
    with_draft = SPSCostTable((2, 10), (2.0, 10.0), draft_rows=(1, 2), draft_time_ms=(20.0, 20.0))
    fewer, more = (batch_schedule(confidences, t, 0.0) for t in (verify_only, with_draft))
    # survivals 0.9, 0.54, 0.27, 0.135 per row; with the 20 ms pass the 0.27s still raise the goodput
    # (5.42 tokens / 28 ms) and the 0.135s do not (5.555 / 29)
    assert fewer == [1, 1] and more == [3, 3]


@pytest.mark.parametrize(
    "counts, times, match",
    [((2, 2), (1.0, 2.0), "strictly increasing"), ((1, 2), (1.0,), "equal length"), ((0,), (1.0,), "token_counts"),
     ((1,), (-1.0,), "step_time_ms")],
)
def test_cost_table_rejects_bad_tables(counts, times, match):
    with pytest.raises(ValueError, match=match):
        SPSCostTable(counts, times)


# ---------------------------------------------------------------------------------- Algorithm 1


def test_prefix_schedule_admits_by_survival_until_goodput_drops():
    # SPS(B) = 1000 / (10 + B). Survivals: r0 0.9, 0.81, 0.081; r1 0.5, 0.25, 0.125.
    # Admission: 0.9 (Θ 223.1) -> 0.81 (265.0) -> 0.5 (280.7) -> 0.25 (278.75 <= 280.7: stop).
    confidences = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.5, 0.5]])
    assert prefix_schedule(confidences, lambda b: 1000.0 / (10 + b)) == [2, 1]


def test_prefix_schedule_stops_at_the_first_non_improvement():
    # Appendix A: admitting x1 lowers goodput (1.8 * 0.5 < 1.0) although x1 and x2 together would
    # raise it ((1 + 0.8 + 0.8) * 0.45 = 1.17): the causal scheduler must not look past x1.
    table = SPSCostTable((1, 2, 3), (1000.0, 2000.0, 1000.0 / 0.45))
    assert prefix_schedule(torch.tensor([[0.8, 1.0]]), table) == [0]
    assert prefix_schedule(torch.tensor([[0.8, 1.0]]), lambda b: 1.0) == [2]  # flat curve: every draft pays
    assert prefix_schedule(torch.tensor([[0.0, 0.0]]), lambda b: 10.0 / b) == [0]
    assert prefix_schedule(torch.tensor([[1.0, 1.0, 1.0]]), lambda b: 1.0 / b ** 0.5) == [3]


def test_prefix_survival_is_the_cumulative_product():
    a = prefix_survival(torch.tensor([[0.5, 0.5, 0.2]]))
    assert torch.allclose(a, torch.tensor([[0.5, 0.25, 0.05]], dtype=torch.float64))


def test_prefix_schedule_rejects_a_non_matrix():
    with pytest.raises(ValueError, match="prefix_schedule: confidences must be 2-D"):
        prefix_schedule(torch.tensor([0.5, 0.5]), lambda b: 1.0)


# ----------------------------------------------------------------------- Appendix A, statistically

TARGET = torch.tensor([0.7, 0.3])  # p over V = {A, B}
DRAFT = torch.tensor([0.5, 0.5])  # q at both draft positions
A1 = 0.8  # c_1
C2 = {0: 1.0, 1: 0.0}  # c_2 depends on the drafted x_1: this is what a retrospective scheduler exploits
SPS = SPSCostTable((1, 2, 3), (1000.0, 2000.0, 1000.0 / 0.45))  # SPS(1, 2, 3) = (1.0, 0.5, 0.45)
DRAWS = 100_000


def _retrospective_schedule(confidences, sps):
    """What Algorithm 1 must NOT do: the best prefix over all lengths (no early stop), i.e. the
    decision on x_1 looks at c_2, which depends on x_1."""
    survival = prefix_survival(confidences)[0]
    goodput = [(1 + float(survival[:n].sum())) * sps.sps(1 + n) for n in range(survival.numel() + 1)]
    return [max(range(len(goodput)), key=goodput.__getitem__)]


def _first_emitted_token(schedule, sps=SPS) -> torch.Tensor:
    """Draft x_1, x_2 ~ q, schedule from c = (a_1, c_2(x_1)), verify, return the first emitted token."""
    n = DRAWS
    u = K.fill_uniforms(n * 8, 2026, 0).view(n, 8)
    draft_probs = DRAFT.expand(n, 2, 2).contiguous()
    drafts = torch.zeros(n, 2, dtype=torch.int32)
    for step in range(2):
        K.sample_probability_rows(draft_probs[:, step].contiguous(), u[:, :2].contiguous(), drafts, step)
    length = {x1: schedule(torch.tensor([[A1, C2[x1]]]), sps)[0] for x1 in (0, 1)}
    lengths = torch.tensor([length[int(x)] for x in (0, 1)])[drafts[:, 0].long()].to(torch.int32)
    first = torch.zeros(n, dtype=torch.int32)
    plain = lengths == 0  # nothing verified: the target samples the token itself
    out = torch.zeros(int(plain.sum()), 1, dtype=torch.int32)
    K.sample_probability_rows(TARGET.expand(out.shape[0], 2).contiguous(), u[plain, 2:3].contiguous(), out, 0)
    first[plain] = out[:, 0]
    rows = ~plain
    if rows.any():
        m = int(rows.sum())
        accepted, _ = K.probabilistic_accept(TARGET.expand(m, 3, 2).contiguous(), draft_probs[rows], drafts[rows],
                                             lengths[rows], u[rows, 3:8].contiguous(), 2)
        first[rows] = accepted[:, 0]
    return first


def _fit(first: torch.Tensor):
    counts = torch.bincount(first.long(), minlength=2).double()
    expected = TARGET.double() * counts.sum()
    p_value = scipy_stats.chisquare(counts.numpy(), expected.numpy()).pvalue
    tv = 0.5 * float((counts / counts.sum() - TARGET.double()).abs().sum())
    return p_value, tv, float(counts[0] / counts.sum())


@pytest.mark.parametrize("sps, lengths", [
    (SPS, {0: 0, 1: 0}),  # the paper's curve: x_1 is never worth verifying
    (SPSCostTable((1, 2, 3), (1000.0, 1000.0 / 0.9, 1000.0 / 0.8)), {0: 2, 1: 1}),  # cheap verification
])
def test_appendix_a_causal_scheduler_is_lossless(sps, lengths):
    assert {x1: prefix_schedule(torch.tensor([[A1, C2[x1]]]), sps)[0] for x1 in (0, 1)} == lengths
    p_value, tv, p_a = _fit(_first_emitted_token(prefix_schedule, sps))
    assert p_value > 1e-3 and tv < 0.01, (p_value, tv, p_a)


def test_appendix_a_retrospective_scheduler_is_not():
    p_value, tv, p_a = _fit(_first_emitted_token(_retrospective_schedule))
    assert p_a == pytest.approx(0.85, abs=0.01)  # the paper's distorted (0.85, 0.15)
    assert p_value < 1e-3 and tv > 0.1


def test_batch_schedule_keeps_a_trim_only_when_it_pays():
    """The engine's cost scheduler: Algorithm 1, at least one draft per row, and TensorRT-LLM's rule --
    a trimmed schedule only when its predicted goodput beats verifying every draft by the margin."""
    import numpy as np

    from dspark.engine import batch_schedule

    conf = np.array([[0.9, 0.9, 0.1], [0.5, 0.05, 0.5]])
    steep = SPSCostTable((1, 2, 8), (1.0, 1.0, 100.0))  # every extra verify token costs a lot
    assert batch_schedule(conf, steep, 0.04) == prefix_schedule_lengths(conf, steep)
    flat = SPSCostTable((1, 8), (10.0, 10.0))  # verifying more is free: every draft
    assert batch_schedule(conf, flat, 0.04) == [3, 3]
    # a schedule that admits nothing for a row still verifies one draft there
    assert min(batch_schedule(np.array([[0.99, 0.99, 0.99], [0.01, 0.01, 0.01]]), steep, 0.0)) == 1


def test_drafting_pays_compares_the_best_round_with_plain_decoding():
    """The cost scheduler's fallback: draft the next round only when the round Algorithm 1 would run
    (verify, draft pass, host time) is predicted to beat a plain round (one token per row) by the margin."""
    import numpy as np

    from dspark.engine.schedulers import drafting_pays

    table = SPSCostTable((1, 64, 128, 512), (5.0, 6.0, 7.0, 15.0), draft_rows=(1, 64), draft_time_ms=(0.3, 1.0))
    sure, unsure = np.full((64, 7), 0.9), np.full((64, 7), 0.05)
    assert drafting_pays(sure, table, 0.04)
    assert not drafting_pays(unsure, table, 0.04)  # ~1.05 tokens a row for a dearer round
    assert not drafting_pays(unsure[:1], table, 0.04)
    # 5.69 expected tokens a row: 364 over 36 ms beats 64 over 7 ms; a slower host per round turns it
    assert drafting_pays(sure, table, 0.04, (20.0, 1.0))
    assert not drafting_pays(sure, table, 0.04, (40.0, 1.0))
    # the margin: a round 3 % better than plain does not pay at 4 %
    one = SPSCostTable((1, 2), (1.0, 1.0))
    assert drafting_pays(np.array([[0.03]]), one, 0.0) and not drafting_pays(np.array([[0.03]]), one, 0.04)


def test_prompt_tokens_in_the_step_price_the_verify_further_up_the_curve():
    """Prompt chunks share the step's forward: Algorithm 1 prices each verify token where the step
    already is -- free on the flat part of the curve, dear once a prefill has taken it up the steep
    one. There drafting stops paying: its 11.7 more tokens take 10.7 ms, where plain rounds make
    17 (8 tokens in 5 ms on the flat part)."""
    import numpy as np

    from dspark.engine.schedulers import batch_schedule, drafting_pays

    curve = SPSCostTable((1, 1024, 2048), (5.0, 5.0, 200.0))
    conf = np.full((8, 7), 0.6)
    assert batch_schedule(conf, curve, 0.0) == [7] * 8
    assert sum(batch_schedule(conf, curve, 0.0, prefill_tokens=1500)) < 7 * 8
    assert drafting_pays(conf, curve, 0.04) and not drafting_pays(conf, curve, 0.04, prefill_tokens=1500)


def test_drafting_is_priced_against_plain_rounds_without_the_steps_prompt_tokens():
    """A step's prompt chunks run whether it drafts or not: what drafting adds -- tokens and time --
    is weighed against plain rounds' rate without them. On a straight cost curve the choice is then
    the same with and without prompt tokens; pricing against a plain round that carries them (its
    time per token up 6x here) drafted at 256 rows where the extra time made more tokens plainly."""
    import numpy as np

    from dspark.engine.schedulers import drafting_pays

    line = SPSCostTable((1, 4096), (5.03, 127.88), draft_rows=(1, 256), draft_time_ms=(5.0, 5.0))  # 5 + 0.03 n ms
    first = np.tile([0.88, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], (256, 1))  # 1.88 tokens a row verifying 1 draft
    for prompt in (0, 500, 2000, 3000):
        # the round verifying one draft a row: 481 tokens in 25.4 ms; plain: 256 in 12.7 ms, 512 in 25.4
        assert not drafting_pays(first, line, 0.0, lengths=[1] * 256, prefill_tokens=prompt)
    # the old price (per token of a round with 2,000 prompt tokens: 481 / 85.4 ms against 256 / 72.7 ms) drafted
    assert 481 / (line.step_time(2512) + 5.0) > 256 / line.step_time(2256)
    sure = np.full((256, 7), 0.95)  # verifying all 7: 6.7 tokens a row for 59 ms more than plain's 12.7
    assert all(drafting_pays(sure, line, 0.0, lengths=[7] * 256, prefill_tokens=p) for p in (0, 2000))


def prefix_schedule_lengths(conf, table):
    return [max(1, n) for n in prefix_schedule(torch.tensor(conf), table)]


def test_batch_schedule_skips_algorithm_1_only_where_its_answer_is_every_draft(monkeypatch):
    """On the flat start of a cost curve (few rows) ``batch_schedule`` answers "verify every draft"
    without running Algorithm 1; it is the answer the full computation gives, on random noisy curves,
    confidences, draft passes, host times and prompt tokens alike -- and the shortcut does fire."""
    import numpy as np

    from dspark.engine import schedulers

    rng = np.random.default_rng(0)
    fired = 0
    for _ in range(300):
        counts = np.unique(rng.integers(1, 600, size=8))
        times = 4.0 + np.sort(rng.uniform(0, 10, counts.size)) * rng.uniform(0, 1) + rng.uniform(0, 0.3, counts.size)
        decode = dict(decode_rows=(1, 64), decode_time_ms=(times[0], times[0] + rng.uniform(0, 8)),
                      tokens_per_row=int(rng.integers(2, 10))) if rng.uniform() < 0.5 else {}
        table = SPSCostTable(tuple(counts.tolist()), tuple(times.tolist()), draft_rows=(1, 64),
                             draft_time_ms=(0.6, rng.uniform(0.6, 2.0)), **decode)
        rows, p = int(rng.integers(1, 65)), int(rng.integers(1, 8))
        confidences = rng.uniform(0, 1, (rows, p)) ** rng.uniform(0.2, 3)
        args = (confidences, table, float(rng.uniform(0, 0.1)), float(rng.uniform(0, 1)), int(rng.integers(0, 200)))
        quick = schedulers.batch_schedule(*args)
        fired += schedulers.full_verify_wins(table, rows, p, *args[2:])
        with monkeypatch.context() as m:
            m.setattr(schedulers, "full_verify_wins", lambda *a: False)
            assert quick == schedulers.batch_schedule(*args)
    assert 10 < fired < 290
