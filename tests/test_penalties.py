"""The controls that read a request's tokens so far -- presence / frequency / repetition penalties,
min_tokens, bad_words -- as vLLM applies them, exact under speculative decoding (``penalties.py``).

Oracles: transformers' processors (``RepetitionPenaltyLogitsProcessor``, ``NoBadWordsLogitsProcessor``,
``MinNewTokensLengthLogitsProcessor``, ``SequenceBiasLogitsProcessor``) and, for presence / frequency
(transformers has none), vLLM's two subtractions as a processor here. transformers matches a bad
word's prefix against prompt + output, vLLM (and dspark) against the output only: the cases here
keep prefixes off the prompt's end, where the two agree. A verify position's oracle is the
processors run on the output with the drafts before it appended; the same positions without the
window's drafts must differ (the check has teeth)."""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from conftest import gpu
from statistics_cases import check_conditionals
from test_request_sampling import demo  # noqa: F401 -- the demo pair's fixture
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList,
                                                    MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from dspark.engine import EngineConfig, LLMEngine, Request, SamplingParams, encode_bad_words
from dspark.engine.penalties import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, PenaltyState, Window
from dspark.engine.rows import LogitsPath

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


class OpenAIPenalties(LogitsProcessor):
    """presence / frequency penalties over the output tokens (``input_ids`` after ``prompt_len``), as
    vLLM's ``apply_penalties`` subtracts them."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def oracle(prompt_len: int, sampling: SamplingParams, stop_ids=()) -> LogitsProcessorList:
    """transformers' processors (and ``OpenAIPenalties``) for ``sampling``, in vLLM's order: bias,
    min_tokens, bad words, repetition, frequency and presence."""
    procs = []
    if sampling.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(i,): b for i, b in sampling.logit_bias}))
    if sampling.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, sampling.min_tokens, sorted(stop_ids)))
    if sampling.bad_words:
        procs.append(NoBadWordsLogitsProcessor([list(w) for w in sampling.bad_words]))
    if sampling.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.presence_penalty or sampling.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, sampling.presence_penalty, sampling.frequency_penalty))
    return LogitsProcessorList(procs)


def expected_logits(logits: torch.Tensor, sampling: SamplingParams, prompt: list[int], output: list[int],
                    stop_ids=()) -> torch.Tensor:
    """The oracle's processed ``logits`` [V] after ``prompt`` and ``output``."""
    ids = torch.tensor([prompt + output])
    return oracle(len(prompt), sampling, stop_ids)(ids, logits[None].clone())[0]


def staged(cases: list[tuple]) -> PenaltyState:
    """A ``PenaltyState`` with case i = ``(sampling, prompt, output, stop_ids)`` staged in slot i."""
    state = PenaltyState(len(cases) + 1, VOCAB, 8, torch.device("cpu"))
    for slot, case in enumerate(cases):
        state.stage(slot, *case)
    state.flush()
    return state


def processed(state: PenaltyState, sampling: list[SamplingParams], logits: torch.Tensor, window=None):
    """The processed logits (bias, masks, penalties) of row i with ``sampling[i]``, staged in slot i."""
    bias = torch.cat([s.rows(1, "cpu", VOCAB).logit_bias if s.logit_bias else torch.zeros(1, VOCAB) for s in sampling])
    rows = replace(sampling[0].rows(1, "cpu"), logit_bias=bias, penalties=state.rows(torch.arange(len(sampling))))
    return rows.processed(logits, window)


PROMPT = [3, 9, 9, 40, 12, 7]
STOPS = frozenset({2, 5})
CASES = [  # (settings, output so far)
    (SamplingParams(repetition_penalty=1.7), [12, 33, 33]),
    (SamplingParams(repetition_penalty=0.6), [50]),
    (SamplingParams(presence_penalty=0.8, frequency_penalty=-0.4), [33, 33, 21, 33]),
    (SamplingParams(min_tokens=4), [33, 21, 8]),  # 3 < 4: stop ids banned
    (SamplingParams(min_tokens=3), [33, 21, 8]),  # 3 >= 3: allowed
    # one-token word; a prefix ending the output; one longer than the output; one not matching
    (SamplingParams(bad_words=((44,), (21, 8, 30), (1, 2, 3, 33, 21, 8, 31), (8, 33, 32))), [33, 21, 8]),
    (SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=9,
                    bad_words=((8, 17), (60,)), logit_bias={17: 4.0, 9: -2.0}), [30, 17, 8]),
    (SamplingParams(), [5, 6]),
]


def test_committed_state_is_transformers_processors():
    """Every control on the committed output (a decode step, a seat's first token): the oracle's logits."""
    state = staged([(s, PROMPT, out, STOPS) for s, out in CASES])
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    got = processed(state, [s for s, _ in CASES], logits)
    for i, (sampling, output) in enumerate(CASES):
        assert torch.equal(got[i], expected_logits(logits[i], sampling, PROMPT, output, STOPS)), sampling


def window_case():
    """A chain round that repeats a penalised draft (21 at 1 and 3), completes a bad word's prefix
    (33, 21 -> 44 banned at position 2) and passes min_tokens mid-window (3 committed + 2 drafts = 5)."""
    sampling = SamplingParams(presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.4, min_tokens=5,
                              bad_words=((33, 21, 44), (60,)))
    output, drafts = [50, 8, 33], [21, 44, 21, 9, 12]
    return sampling, output, drafts


def test_each_verify_position_counts_the_drafts_before_it():
    """Position l of a chain window (after drafts 1..l) is the oracle on the output plus those drafts;
    the committed state alone is not (the window matters at these positions)."""
    sampling, output, drafts = window_case()
    state = staged([(sampling, PROMPT, output, STOPS)])
    tokens = torch.tensor([[output[-1]] + drafts])  # the anchor (committed), then the drafts
    logits = torch.randn(1, tokens.shape[1], VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    got = processed(state, [sampling], logits, Window.chain(tokens))[0]
    expected = torch.stack([expected_logits(logits[0, l], sampling, PROMPT, output + drafts[:l], STOPS)
                            for l in range(tokens.shape[1])])
    assert torch.equal(got, expected)
    without = processed(state, [sampling], logits)[0]
    assert all(not torch.equal(without[l], expected[l]) for l in range(1, tokens.shape[1]))


def test_each_tree_node_counts_its_ancestors():
    """A tree node's logits are the oracle on the output plus the tokens from the root's child down
    to the node -- its siblings' and cousins' tokens are not in its output."""
    sampling, output, _ = window_case()
    #        0 (anchor 33)
    #       / \
    #   1: 21  2: 9
    #     |  \     \
    #  3: 44 4: 21  5: 21
    tokens = torch.tensor([[33, 21, 9, 44, 21, 21]])
    parents = [-1, 0, 0, 1, 1, 2]
    depths = torch.tensor([[0, 1, 1, 2, 2, 2]])
    paths = [[]]
    for node in range(1, 6):
        paths.append(paths[parents[node]] + [node])
    bits = torch.tensor([[sum(1 << n for n in [0] + path) for path in paths]])
    state = staged([(sampling, PROMPT, output, STOPS)])
    logits = torch.randn(1, 6, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    got = processed(state, [sampling], logits, Window.tree(tokens, depths, bits))[0]
    for node, path in enumerate(paths):
        appended = [int(tokens[0, n]) for n in path]
        expected = expected_logits(logits[0, node], sampling, PROMPT, output + appended, STOPS)
        assert torch.equal(got[node], expected), node


def test_committed_tokens_join_the_state():
    """``commit`` appends accepted tokens (a round's first n): the state is then the one staged with
    the longer output; rows of length 0 change nothing."""
    sampling, output, drafts = window_case()
    state = staged([(sampling, PROMPT, output, STOPS), (sampling, PROMPT, output, STOPS)])
    state.commit(torch.tensor([0, 1]), torch.tensor([drafts, drafts], dtype=torch.int32),
                 torch.tensor([3, 0], dtype=torch.int32))
    again = staged([(sampling, PROMPT, output + drafts[:3], STOPS), (sampling, PROMPT, output, STOPS)])
    for name in ("counts", "flags", "produced", "recent"):
        assert torch.equal(getattr(state, name)[:2], getattr(again, name)[:2]), name


def test_bad_words_are_tokenized_as_vllm():
    """Each word (leading spaces stripped) as it is and, when a leading space makes other tokens of
    the same count, with one (vLLM's ``SamplingParams.update_from_tokenizer``)."""
    from transformers import AutoTokenizer

    from dspark.training.data import demo_pair

    tokenizer = AutoTokenizer.from_pretrained(str(demo_pair().target))

    def encoded(text):
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    assert len(encoded(" 123")) != len(encoded("123"))  # so "123" has no spaced form
    assert encode_bad_words(["import os", "  def", "123"], tokenizer) == (
        encoded("import os"), encoded(" import os"), encoded("def"), encoded(" def"), encoded("123"))
    with pytest.raises(ValueError, match=r"generate: bad_words\[1\] is empty: it has no tokens"):
        encode_bad_words(["x", "\n "], tokenizer)
    too_long = rf"bad_words\[0\] \('{'a b ' * 10}.*is \d+ tokens; at most {MAX_BAD_WORD_TOKENS}"
    with pytest.raises(ValueError, match=too_long):
        encode_bad_words(["a b " * 20], tokenizer)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by the tensors the ops inside allocate (a storage counts from the op
    that made it until it is freed; views and in-place results add nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.held: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is None or id(storage) in self.held or storage.data_ptr() in inputs:
                continue
            self.held.add(id(storage))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.held.discard(key)
        self.live -= nbytes


def test_the_penalty_pass_allocates_one_copy_of_the_window():
    """The request stage over a verify window ``[B, L, V]`` with every control on allocates one f32
    copy of the window's logits and ``[B, V]`` temporaries (the penalties a position at a time), as
    ``WorkingMemory`` budgets: each window-sized temporary more is 1.2 GB at 256 rows of 8 positions
    over a 152k vocabulary. The logits are those of the penalties applied to the whole window at once."""
    vocab, batch, positions = 4096, 2, 6
    sampling, output, drafts = window_case()
    state = PenaltyState(batch + 1, vocab, positions, torch.device("cpu"))
    for slot in range(batch):
        state.stage(slot, sampling, PROMPT, output, STOPS)
    state.flush()
    rows = replace(sampling.rows(batch, "cpu"), logit_bias=torch.zeros(batch, vocab),
                   penalties=state.rows(torch.arange(batch)))
    logits = torch.randn(batch, positions, vocab, generator=torch.Generator().manual_seed(3)) * 3
    window = Window.chain(torch.tensor([output[-1:] + drafts] * batch))
    with LiveBytes() as memory:
        got = rows.processed(logits, window)
    assert memory.peak <= logits.numel() * 4 + 24 * batch * vocab, (memory.peak, logits.numel() * 4)
    assert torch.equal(got, rows.penalties.apply(logits, window))


def test_bad_settings_name_the_field():
    cases = [(dict(presence_penalty=2.5), ValueError, r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
             (dict(frequency_penalty=-3), ValueError, r"frequency_penalty must be in \[-2.0, 2.0\], got -3"),
             (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be > 0, got 0.0"),
             (dict(repetition_penalty="2"), TypeError, "repetition_penalty must be a float, got str"),
             (dict(min_tokens=-1), ValueError, r"min_tokens must be in \[0, inf\], got -1"),
             (dict(bad_words="no"), TypeError, "bad_words must be a list of token-id sequences, got str"),
             (dict(bad_words=[[]]), TypeError, r"bad_words\[0\] must be a non-empty list of token ids, got \[\]"),
             (dict(bad_words=[[1, -2]]), ValueError, r"bad_words\[0\] token id must be in \[0, inf\], got -2"),
             (dict(bad_words=[list(range(MAX_BAD_WORD_TOKENS + 1))]), ValueError,
              rf"bad_words\[0\] may hold at most {MAX_BAD_WORD_TOKENS} tokens, got {MAX_BAD_WORD_TOKENS + 1}"),
             (dict(bad_words=[[1, i] for i in range(MAX_BAD_WORDS + 1)]), ValueError,
              f"bad_words may hold at most {MAX_BAD_WORDS} sequences of two tokens or more, got {MAX_BAD_WORDS + 1}")]
    for kwargs, kind, message in cases:
        with pytest.raises(kind, match="SamplingParams: " + message):
            SamplingParams(**kwargs)
    assert SamplingParams(bad_words=[[5], (1, 2)]).bad_words == ((5,), (1, 2))
    assert SamplingParams(bad_words=[[i] for i in range(1000)]).reads_history  # one-token words: any number


# ---------------------------------------------------------------------------- through the engine

NEW_TOKENS = 24
MODES = {"plain": None, "speculative": {}, "tree": dict(draft_top_k=2)}


def transformers_greedy(model, prompt: list[int], sampling: SamplingParams, stop_ids=(),
                        new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy ``generate()`` with ``oracle``'s processors, ending at a stop id (else
    after ``new_tokens``, the model's EOS kept out as ``ignore_eos``)."""
    ends = dict(eos_token_id=sorted(stop_ids)) if stop_ids else dict(eos_token_id=None, min_new_tokens=new_tokens)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=oracle(len(prompt), sampling, stop_ids), **ends)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def greedy_cases(demo):
    """(name, settings, stop ids, transformers' output) of greedy requests, each control binding:
    every output differs from plain greedy decoding (which would stop at ``plain[6]`` as a stop id)."""
    _, model, prompt, plain = demo
    stop = (plain[6],)
    assert prompt[-1] not in (plain[3], plain[5])  # the bad words' prefixes are off the prompt's end
    cases = [("repetition", SamplingParams(repetition_penalty=1.3), ()),
             ("presence, frequency", SamplingParams(presence_penalty=1.5, frequency_penalty=0.9), ()),
             ("min_tokens", SamplingParams(min_tokens=12), stop),
             ("bad_words", SamplingParams(bad_words=((plain[8],), (plain[3], plain[4]))), ()),
             ("all", SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=10,
                                    bad_words=((plain[5], plain[6]), (plain[11],)), logit_bias={plain[2]: -3.0}), stop)]
    cases = [(name, sampling, stops, transformers_greedy(model, prompt, sampling, stops))
             for name, sampling, stops in cases]
    for name, _, stops, expected in cases:
        assert expected != (plain[:7] if stops else plain), name
    return cases


def penalised_sampled(prompt: list[int], plain: list[int]) -> Request:
    """A sampled request with penalties, min_tokens and bad words."""
    sampling = SamplingParams(0.9, top_p=0.9, seed=5, repetition_penalty=1.3, presence_penalty=0.7, min_tokens=3,
                              bad_words=((plain[0],), (plain[1], plain[2])))
    return Request(prompt, NEW_TOKENS, sampling, stop_ids=(plain[6],), ignore_eos=True)


def assert_mixed_batch(engine: LLMEngine, demo, greedy_cases) -> list[int]:
    """``greedy_cases``' requests, a plain greedy one and ``penalised_sampled`` in one batch on
    ``engine``: each greedy output is transformers' (the plain one plain greedy decoding's). Returns
    the sampled request's tokens."""
    _, _, prompt, plain = demo
    requests = [Request(prompt, NEW_TOKENS, sampling, stop_ids=stops, ignore_eos=True)
                for _, sampling, stops, _ in greedy_cases]
    out = engine.generate(requests + [Request(prompt, NEW_TOKENS, SamplingParams(), ignore_eos=True),
                                      penalised_sampled(prompt, plain)])
    for (name, _, _, expected), result in zip(greedy_cases, out):
        assert result.token_ids == expected, name
    assert out[-2].token_ids == plain
    return out[-1].token_ids


@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_transformers_generate(demo, greedy_cases, mode):
    """Greedy requests with each control and all of them (with a bias) in one batch beside a plain
    greedy and a sampled request with penalties: each output is transformers' ``generate()`` with
    the same processors, plain decoding's, DSpark's and tree mode's alike; the sampled request gives
    the same tokens again beside another request, and a plain request later seated where penalised
    ones ran stays plain."""
    pair, _, prompt, plain = demo
    draft = None if MODES[mode] is None else str(pair.draft)
    engine = LLMEngine(str(pair.target), draft, EngineConfig(max_batch=8, max_model_len=256, **(MODES[mode] or {})))
    sampled = assert_mixed_batch(engine, demo, greedy_cases)
    again = engine.generate([penalised_sampled(prompt, plain), Request(prompt, NEW_TOKENS, SamplingParams(),
                                                                       ignore_eos=True)])
    assert again[0].token_ids == sampled and again[1].token_ids == plain


@pytest.mark.parametrize("mode", ["plain", "speculative"])
def test_the_penalty_pass_runs_only_for_batches_that_read_history(demo, mode):
    """A batch whose rows only sample takes the ``SAMPLED`` path, without the penalty pass; one with
    a penalised row takes ``PENALISED``. The sampled request's tokens are the same on either path
    (neutral settings change no logit), so its output does not depend on its batch."""
    pair, _, prompt, plain = demo
    draft = None if MODES[mode] is None else str(pair.draft)
    engine = LLMEngine(str(pair.target), draft, EngineConfig(max_batch=4, max_model_len=256, **(MODES[mode] or {})))
    sampled = Request(prompt, NEW_TOKENS, SamplingParams(0.8, top_p=0.9, seed=3), ignore_eos=True)
    met, replay = [], engine.runner._replay
    engine.runner._replay = lambda key, fn: (met.append(key[-1]), replay(key, fn))
    alone = engine.generate([sampled])[0].token_ids
    assert LogitsPath.SAMPLED in met and LogitsPath.PENALISED not in met
    met.clear()
    beside = engine.generate([sampled, penalised_sampled(prompt, plain)])[0].token_ids
    assert LogitsPath.PENALISED in met
    assert beside == alone


@gpu
@pytest.mark.parametrize("mode", ["speculative", "tree"])
def test_cuda_graphs_replay_penalised_rows(demo, greedy_cases, mode):
    """On CUDA (float32) with every graph captured up front: the mixed batch as on the CPU, the
    sampled request's tokens the same alone, and no step captures a graph."""
    pair, _, prompt, plain = demo
    engine = LLMEngine(str(pair.target), str(pair.draft), EngineConfig(
        max_batch=8, max_model_len=256, device="cuda", dtype=torch.float32, **MODES[mode]))
    engine.capture_graphs()
    captured = engine.runner.captures
    alone = engine.generate([penalised_sampled(prompt, plain)])[0].token_ids
    assert assert_mixed_batch(engine, demo, greedy_cases) == alone
    assert engine.runner.captures == captured and not engine.runner.uncapturable


def test_drafts_of_the_penalised_output_are_all_accepted(demo):
    """Benchmark drafts that are the penalised greedy output itself (acceptance 1): every draft is
    accepted and the output is transformers'. A window that left out the drafts before a position
    would reject the drafts whose choice the earlier drafts' penalties decided."""
    from dspark.bench.oracle import OracleEngine

    pair, model, prompt, plain = demo
    sampling = SamplingParams(repetition_penalty=1.5, presence_penalty=2.0, frequency_penalty=1.0,
                              bad_words=((plain[3], plain[4]),))
    expected = transformers_greedy(model, prompt, sampling)
    engine = OracleEngine(str(pair.target), str(pair.draft), EngineConfig(max_batch=2, max_model_len=256),
                          acceptance=1.0)
    engine.add_request(Request(prompt, NEW_TOKENS, sampling, ignore_eos=True), oracle_ids=expected)
    tokens = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
    assert tokens == expected
    assert engine.metrics.accepted_tokens == engine.metrics.draft_tokens > 0, "a draft of the output was rejected"


# ---------------------------------------------------------------------------- sampled, through the engine

# about 51 000 draws (rows stop after min_tokens) in 10 bins: an exact sampler's TV ~ 0.4 * sqrt(10 / N) = 0.0056
SAMPLED_VOCAB, SAMPLED_ROWS, SAMPLED_TOKENS = 5, 256, 256
SAMPLED_STOP = 4
SAMPLED = SamplingParams(1.0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.6, min_tokens=200,
                         bad_words=((1, 2),))


@pytest.fixture(scope="module")
def penalised_pair(one_thread):
    """A bigram target (its next token depends on the last one only), its logits after each token
    ``[V, V]`` and a random draft."""
    from model_cases import random_draft, tiny_draft_config
    from test_lossless_sampling import bigram_target

    target, logits = bigram_target(SAMPLED_VOCAB)
    draft = random_draft(tiny_draft_config(target.config, layer_types=["full_attention"]), 0, target)
    return target, logits, draft


def transformers_conditionals(sequences: list[list[int]], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output token of ``sequences`` (prompt token, then output) and the distribution it was
    drawn from given everything before it: the bigram logits after the last token through ``oracle``'s
    processors for ``SAMPLED``, softmaxed (temperature 1). Returns (tokens [N], probs [N, V], previous [N])."""
    tokens, probs, previous = [], [], []
    for t in range(1, max(map(len, sequences))):
        rows = torch.tensor([s[:t + 1] for s in sequences if len(s) > t])
        scores = oracle(1, SAMPLED, {SAMPLED_STOP})(rows[:, :t], logits[rows[:, t - 1]].clone())
        tokens.append(rows[:, t])
        probs.append(scores.softmax(-1))
        previous.append(rows[:, t - 1])
    return torch.cat(tokens), torch.cat(probs), torch.cat(previous)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_outputs_follow_the_processed_distribution(penalised_pair, mode):
    """Speculative sampling (chain and tree) with every control (temperature 1): each token of 256
    seeded requests is distributed as the target's processed distribution given its history --
    binned by token and by whether it repeats the token before it -- and no banned token (a stop id
    before min_tokens, a bad word's end) is ever drawn. A window that leaves out the drafts before a
    position fails both (TV 0.04, and banned draws)."""
    target, logits, draft = penalised_pair
    tree = dict(draft_top_k=2) if mode == "tree" else {}
    engine = LLMEngine(target, draft, EngineConfig(max_batch=SAMPLED_ROWS, **tree))
    requests = [Request([0], SAMPLED_TOKENS, replace(SAMPLED, seed=seed), stop_ids=(SAMPLED_STOP,), ignore_eos=True)
                for seed in range(SAMPLED_ROWS)]
    sequences = [[0] + r.token_ids for r in engine.generate(requests)]
    tokens, probs, previous = transformers_conditionals(sequences, logits)
    bins = torch.arange(SAMPLED_VOCAB) * 2 + (torch.arange(SAMPLED_VOCAB) == previous[:, None])
    problem = check_conditionals(tokens, probs, bins)
    assert problem is None, problem
