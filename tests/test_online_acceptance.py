"""The online acceptance estimator (``acceptance.OnlineAcceptance``), the schedulers' alternative
signal to the confidence head: its updates by hand, and the engine on it -- exact (greedy output is
plain decoding's), no wait for the draft pass, no confidence head needed."""

import numpy as np
import pytest
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target
from test_engine import _greedy

from dspark.bench.oracle import OracleEngine
from dspark.engine import EngineConfig, LLMEngine, Request
from dspark.engine.acceptance import OnlineAcceptance, round_outcomes
from dspark.engine.schedulers import SPSCostTable

PROMPTS = [[3, 17, 42, 8, 61, 5], [9, 1], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18], [60]]
NEW = 14


def test_a_round_observes_each_position_up_to_its_first_rejection():
    tried, hit = round_outcomes(4, np.array([3, 3, 2, 0]), np.array([1, 3, 2, 0]))
    assert tried.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert hit.tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


def test_updates_shrink_a_request_towards_the_pooled_rate():
    """One rejection at position 0 of slot 0 (decay 0.9, row prior weight 2, pooled decay 0.99 and an
    optimistic prior of weight 1): the pooled rate of position 0 is 0.99 / 1.99, slot 0's estimate
    (0 + 2 * pooled) / (1 + 2), its unobserved position 1 the pooled 1.0, another slot the pooled rates."""
    est = OnlineAcceptance(3, 2)
    assert est.estimate([0, 1]).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    est.observe([0], [2], [0])
    pooled = 0.99 / 1.99
    assert est.pooled == pytest.approx([pooled, 1.0])
    assert est.estimate([0, 2]) == pytest.approx(np.array([[2 * pooled / 3, 1.0], [pooled, 1.0]]))
    est.observe([0, 1], [2, 2], [2, 1])  # slot 0 accepts both; slot 1 one then a rejection
    hits, trials = np.array([1.0, 1.0]), np.array([0.9 + 1, 1.0])
    pooled = (np.array([0.99 * 0.99 + 2, 0.99 * 0.99 + 1]) / np.array([0.99 * 1.99 + 2, 0.99 * 0.99 + 2]))
    assert est.pooled == pytest.approx(pooled)
    assert est.estimate([0])[0] == pytest.approx((hits + 2 * pooled) / (trials + 2))
    est.reset(0)
    assert est.estimate([0])[0] == pytest.approx(pooled)


def test_rows_without_drafts_observe_nothing_and_stale_evidence_fades():
    est = OnlineAcceptance(2, 3, decay=0.5)
    est.observe([0], [3], [0])  # position 0 rejected
    low = est.estimate([0])[0, 0]
    est.observe([0, 1], [0, 0], [0, 0])  # plain rounds: nothing seen, nothing forgotten
    assert est.estimate([0])[0, 0] == low
    for _ in range(30):  # slot 1 keeps accepting everything; slot 0 only its first draft now
        est.observe([0, 1], [1, 3], [1, 3])
    rates = est.estimate([0])[0]
    assert rates[0] > 0.95 and rates[2] == pytest.approx(est.pooled[2], abs=1e-3)  # back to the pooled rate


def test_the_estimator_checks_its_settings():
    with pytest.raises(ValueError, match="decay must be"):
        OnlineAcceptance(2, 3, decay=1.5)
    with pytest.raises(ValueError, match="prior_weight must be > 0"):
        OnlineAcceptance(2, 3, prior_weight=0.0)
    with pytest.raises(ValueError, match="schedule_signal 'online' needs the threshold, sps or cost scheduler"):
        EngineConfig(schedule_signal="online")
    with pytest.raises(ValueError, match="schedule_signal must be one of"):
        EngineConfig(scheduler="sps", schedule_signal="oracle")


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


@pytest.fixture(scope="module")
def greedy(target):
    return [_greedy(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("scheduler", ["threshold", "sps", "cost"])
def test_the_engine_on_the_online_signal_is_exact_and_never_waits_for_the_draft_pass(target, greedy, scheduler):
    """Greedy output equals plain decoding whatever the estimates decide, the host never reads the
    draft pass's proposals, and the estimator saw the rounds the engine counted. The draft here has
    no confidence head: the online signal needs none."""
    draft = random_draft(tiny_draft_config(target.config, confidence=False), 0, target)
    engine = LLMEngine(target, draft, EngineConfig(max_batch=3, scheduler=scheduler, threshold=0.3,
                                                   cost_table=SPSCostTable((1, 64), (1.0, 4.0)),
                                                   schedule_signal="online"))
    engine.runner.read_proposals = lambda rows: pytest.fail("the online signal read the draft pass's proposals")
    results = engine.generate([Request(p, NEW) for p in PROMPTS])
    assert [r.token_ids for r in results] == greedy
    tried = engine.acceptance.pooled_trials - 1.0  # the initial prior's weight aside, decayed counts
    assert tried[0] > 0 and engine.metrics.position_trials[0] >= tried[0]
    if scheduler == "cost":  # --compare's baseline: plain decoding, which reads no signal
        assert engine.plain().config.schedule_signal == "confidence"


def test_the_online_signal_verifies_what_is_accepted(target, greedy):
    """Drafts that are always accepted (the greedy continuation): the threshold scheduler on the
    online signal keeps verifying every draft; drafts always rejected: after the first rounds it
    verifies one (the least it may), where the confidences of a random head would not tell."""
    draft = random_draft(tiny_draft_config(target.config), 0, target)
    config = EngineConfig(max_batch=2, scheduler="threshold", threshold=0.5, schedule_signal="online")
    lengths = {}
    for acceptance in (1.0, 0.0):
        engine = OracleEngine(target, draft, config, acceptance=acceptance)
        ids = [engine.add_request(Request(p, NEW), g + [0] * 8) for p, g in zip(PROMPTS[:2], greedy)]
        while engine.has_unfinished():
            engine.step()
        assert [engine.sequences[i].output_ids for i in ids] == greedy[:2]
        lengths[acceptance] = [n for i in ids for n in engine.sequences[i].stats.scheduled_lengths[1:-1]]
    p = engine.num_drafts
    assert set(lengths[1.0]) == {p}
    assert lengths[0.0][-1] == 1 and sum(lengths[0.0]) < p * len(lengths[0.0]) / 2


def test_the_signals_bench_scores_a_signal_that_knows_each_request():
    """``bench.signals`` on two kinds of requests -- every draft accepted, or none -- whose confidences
    say 0.5 everywhere: the online estimator learns each request (better ECE, Brier and AUC) and,
    priced by a table where verify tokens cost, verifies what is accepted (more goodput than the
    confidences, at most the oracle's; fixed blocks the unit)."""
    from dspark.bench.signals import calibration, goodput

    p = 3
    traces = [[[p] + [0.5] * p] * 40, [[0] + [0.5] * p] * 40] * 3
    report = calibration(traces)
    online, confidence = report["online"], report["confidence"]
    assert online["ece"] < confidence["ece"] and online["brier"] < confidence["brier"]
    assert online["auc"] > 0.9 and confidence["auc"] == 0.5
    table = SPSCostTable((1, 64), (10.0, 73.0))  # 10 ms a step and 1 ms a verify token
    result = goodput(traces, 4, table, steps=200)
    assert result["online"]["tokens_per_ms"] > 1.1 * max(result["confidence"]["tokens_per_ms"],
                                                          result["fixed"]["tokens_per_ms"])
    assert result["online"]["tokens_per_ms"] <= result["oracle"]["tokens_per_ms"]
    assert result["oracle"]["tau"] == result["fixed"]["tau"]  # the oracle verifies only what is accepted
