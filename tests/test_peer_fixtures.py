"""dspark against draft checkpoints written by its peers' own code, and the peers' own outputs.

The fixtures live in ``tests/fixtures/peers`` (data only): their README says how each was produced and the tolerances used here. One test per fixture
folder: load the peer's checkpoint (speculators 0.9 ones with the target, which holds the weights
they leave out), read its config as the fixture's ``expected_config`` states, and compare every
tensor of ``expected.safetensors``: the captured target hidden states (the engine's target
adapter), block hidden states / logits / Markov-corrected logits / confidence logits (the draft
model's own forward and heads, round by round through its cache), the greedy drafts and their
confidences (the engine's ``Drafter``), for speculators the trainer's forward on the same blocks
(its training forward is that peer's reference), and for DeepSpec the decoding loop's output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_cases import tiny_qwen3_target
from safetensors.torch import load_file
from test_engine import _greedy

import dspark
import dspark.kernels as K
from dspark.cli import main
from dspark.engine import Drafter, EngineConfig, LLMEngine, Request, SamplingParams, SpeculativeDecoder
from dspark.model import load_draft, save_draft
from dspark.training import trainer
from dspark.training.objective import position_weights

PEERS = Path(__file__).resolve().parent / "fixtures" / "peers"

SPECULATORS_CASES = ["speculators-vanilla", "speculators-gated", "speculators-rnn-sfa-false",
                     "speculators-reduced-vocab", "speculators-sliding-w5-causal", "speculators-bf16",
                     "speculators-markov-rank0", "speculators-dflash"]
DEEPSPEC_CASES = ["deepspec-vanilla", "deepspec-gated", "deepspec-rnn", "deepspec-confidence-markov",
                  "deepspec-confidence-hidden", "deepspec-target-ids-minus1"]
# Keys of the peers' config.json that Hugging Face's Qwen3Config / PretrainedConfig fill with their
# defaults when absent (or that only record the writer's transformers version): no loader needs them.
HF_DEFAULTED = {"transformers_version", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
                "initializer_range", "max_position_embeddings", "max_window_layers", "use_cache"}


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(PEERS / "target", dtype=torch.float32).eval()


def read_case(name: str):
    folder = PEERS / name
    assert folder.is_dir(), f"fixture folder {folder} is missing"
    meta = json.loads((folder / "meta.json").read_text())
    return folder, meta, load_file(str(folder / "expected.safetensors"))


# ---- comparisons with the README's tolerances ----------------------------------------------------------


def assert_abs(name, ours, peer, tol):
    diff = (ours.double() - peer.double()).abs().max().item()
    assert diff <= tol, f"{name}: max |diff| {diff:.3g} > {tol:.3g}"


def assert_logits(name, ours, peer, rel):
    assert_abs(name, ours, peer, rel * max(1.0, peer.double().abs().max().item()))


def peer_columns(model, logits):
    """Our target-vocabulary logits ``[..., V_t]`` in the peer's columns (draft ids for a reduced vocabulary)."""
    ids = model.draft_to_target_ids
    return logits if ids is None else logits[..., ids]


def column_of(model, token):
    ids = model.draft_to_target_ids
    if ids is None:
        return token
    hits = (ids == token).nonzero()
    assert hits.numel() == 1, f"token {token} is outside the draft vocabulary"
    return int(hits[0])


def assert_greedy(name, model, ours, peer, peer_logits, tol):
    """Greedy tokens ``[A, P]``: equal per block; a differing slot only as a near-tie of the peer's
    logits (comparison stops there), or, in bfloat16, enough of them equal. Returns, per block, how
    many leading slots agree (the slots whose chain, hence confidence, is comparable)."""
    agree = []
    if "greedy_tokens_min_fraction" in tol:
        fraction = (ours == peer).double().mean().item()
        assert fraction >= tol["greedy_tokens_min_fraction"], f"{name}: {fraction:.0%} of the greedy tokens agree"
    for j in range(peer.shape[0]):
        k = 0
        while k < peer.shape[1] and int(ours[j, k]) == int(peer[j, k]):
            k += 1
        if k < peer.shape[1] and "greedy_tokens_min_fraction" not in tol:
            row = peer_logits[j, k].double()
            gap = (row[column_of(model, int(peer[j, k]))] - row[column_of(model, int(ours[j, k]))]).item()
            assert gap <= tol["near_tie_logit_gap"], f"{name}: block {j} slot {k} differs, peer logit gap {gap:.3g}"
        agree.append(k)
    return agree


# ---- the draft model round by round, and the engine's drafter -----------------------------------------


def check_config(config, expected):
    names = {"capture_hidden_states_indices": "capture_layer_ids"}
    for key, value in expected.items():
        assert getattr(config, names.get(key, key)) == value, f"config {key}: {getattr(config, names.get(key, key))!r} != {value!r}"


def check_capture(target, config, expected, tol):
    """The draft's capture_layer_ids name (as Hugging Face ``hidden_states`` indices) what the peer
    fed its draft; test_llm_engine checks that the engine captures those hidden states."""
    peer = expected["context_hidden"]
    with torch.no_grad():
        states = target(input_ids=expected["input_ids"].view(1, -1), output_hidden_states=True).hidden_states
    ours = torch.cat([states[i][0] for i in config.capture_layer_ids], dim=-1)
    assert_logits("context_hidden", ours.to(peer.dtype), peer, tol["captured_target_hidden_rel"])


def check_blocks(model, expected, tol):
    """Block hidden, backbone, corrected and confidence logits of every block, the draft cache
    growing by ``context_hidden[p_{j-1}:p_j]`` before block j (README "Rounds")."""
    context, cache, start = expected["context_hidden"], model.new_cache(), 0
    for j, (p, anchor) in enumerate(zip(expected["anchor_positions"].tolist(), expected["anchor_tokens"].tolist())):
        hidden = model.forward_block(cache, context[start:p].to(model.dtype), anchor, p)
        start = p
        assert_abs(f"block_hidden[{j}]", hidden.float(), expected["block_hidden"][j].float(), tol["block_hidden_abs"])
        logits = model.backbone_logits(hidden)
        assert_logits(f"backbone_logits[{j}]", peer_columns(model, logits), expected["backbone_logits"][j].float(),
                      tol["logits_rel"])
        prev = expected["markov_prev_tokens"][j] if "markov_prev_tokens" in expected else None
        if "corrected_logits" in expected:
            state, corrected = None, []
            for k in range(hidden.shape[0]):  # every slot in order: the rnn state runs through slot 0 too
                bias, state = model.markov_bias(hidden[k:k + 1], prev[k:k + 1], state)
                corrected.append(logits[k] + bias[0])
            assert_logits(f"corrected_logits[{j}]", peer_columns(model, torch.stack(corrected)),
                          expected["corrected_logits"][j].float(), tol["logits_rel"])
        if "confidence_logits" in expected:
            ours = model.confidence_logits(hidden[None], prev[None])[0]
            assert_abs(f"confidence_logits[{j}]", ours, expected["confidence_logits"][j].float(),
                       tol["confidence_logits_abs"])


def drafter_rounds(model, expected, sampling=SamplingParams()):
    """The engine's drafts for the fixture's blocks: tokens ``[A, P]``, confidences ``[A, P]`` (None
    without a confidence head) and, when sampling, the distributions q ``[A, P, V]`` they came from."""
    scheduler = "threshold" if model.confidence_head is not None else "off"
    drafter = Drafter(model, scheduler=scheduler, threshold=0.0)
    p_drafts = model.config.num_draft_tokens
    context, start, rounds, cache = expected["context_hidden"], 0, [], model.new_cache()
    for j, (p, anchor) in enumerate(zip(expected["anchor_positions"].tolist(), expected["anchor_tokens"].tolist())):
        uniforms = None if sampling.greedy else K.fill_uniforms(p_drafts, sampling.seed, j * p_drafts).view(1, -1)
        anchor = torch.tensor([anchor], dtype=torch.int32)
        hidden = model.forward_block(cache, context[start:p].to(model.dtype), anchor, p)
        proposal = drafter.propose_rows(hidden, model.backbone_logits(hidden), anchor,
                                       None if sampling.greedy else sampling.rows(1, model.device), uniforms)
        start = p
        rounds.append(proposal)
    tokens = torch.stack([r.token_ids[0].long() for r in rounds])
    confidence = None if rounds[0].confidence is None else torch.stack([r.confidence[0] for r in rounds])
    q = None if sampling.greedy else torch.stack([r.probabilities[0] for r in rounds])
    return tokens, confidence, q


def check_drafter(name, model, expected, tol, greedy_logits, greedy_confidence_logits):
    """Greedy drafts and their confidences against the peer's greedy chain, and the sampled drafter's
    q (temperature 1) against the peer's corrected logits for as long as its chain is the peer's."""
    tokens, confidence, _ = drafter_rounds(model, expected)
    agree = assert_greedy(name, model, tokens, expected["greedy_tokens"], greedy_logits, tol)
    if confidence is not None:
        # the kernels take half-precision heads; an fp32 draft's heads run in fp32 (engine/drafting.py)
        sigmoid_tol = tol["confidence_logits_abs"] if model.dtype == torch.float32 else tol["confidence_sigmoid_kernel_abs"]
        for j, k in enumerate(agree):
            assert_abs(f"drafter confidence[{j}]", confidence[j, :k],
                       torch.sigmoid(greedy_confidence_logits[j, :k].float()), sigmoid_tol)
    sampled, _, q = drafter_rounds(model, expected, SamplingParams(temperature=1.0, seed=11))
    for j in range(sampled.shape[0]):
        for k in range(sampled.shape[1]):  # slot k's previous token is the peer's while the chains agree
            peer = torch.log_softmax(greedy_logits[j, k].double(), -1)
            ours = peer_columns(model, q[j, k].double().log())
            assert_abs(f"drafter log q[{j}, {k}]", ours, peer, 2 * tol["logits_rel"] * max(1.0, peer.abs().max().item()))
            if int(sampled[j, k]) != int(expected["greedy_tokens"][j, k]):
                break


# ---- the trainer's forward (speculators' reference is its training forward) ----------------------------


def check_trainer(model, target, expected, tol, monkeypatch):
    """``draft_loss`` on the fixture's sequence with its anchors: the batched block hidden states,
    the teacher-forced previous tokens, the corrected and the confidence logits are the peer's."""
    seen = {}
    real_markov_logits = trainer.markov_logits

    def markov_logits(m, hidden, prev):
        seen.update(hidden=hidden, prev=prev)
        seen["logits"] = real_markov_logits(m, hidden, prev)
        return seen["logits"]

    anchors = expected["anchor_positions"][None]
    monkeypatch.setattr(trainer, "markov_logits", markov_logits)
    monkeypatch.setattr(trainer, "sample_anchors", lambda *args, **kwargs: anchors)
    monkeypatch.setattr(trainer, "dspark_loss", lambda *args, **kwargs: seen.setdefault("confidence", args[2]))
    cfg = model.config
    with torch.no_grad():
        trainer.draft_loss(model, target, expected["input_ids"][None], anchors.shape[1],
                           position_weights(cfg.block_size, 4.0, cfg.sample_from_anchor))
    assert_abs("trainer block hidden", seen["hidden"].float(), expected["block_hidden"].float(), tol["block_hidden_abs"])
    if "markov_prev_tokens" in expected:
        assert torch.equal(seen["prev"], expected["markov_prev_tokens"])
    if "corrected_logits" in expected:
        assert_logits("trainer corrected logits", peer_columns(model, _full_vocab(model, seen["logits"])),
                      expected["corrected_logits"].float(), tol["logits_rel"])
    if "confidence_logits" in expected:
        assert_abs("trainer confidence logits", seen["confidence"], expected["confidence_logits"].float(),
                   tol["confidence_logits_abs"])


def _full_vocab(model, logits):
    """The trainer's draft-vocabulary logits ``[..., V_d]`` placed at their target ids."""
    ids = model.draft_to_target_ids
    if ids is None:
        return logits
    return logits.new_full((*logits.shape[:-1], model.config.vocab_size), float("-inf")).index_copy_(-1, ids, logits)


# ---- one test per fixture folder -----------------------------------------------------------------------


@pytest.mark.parametrize("name", SPECULATORS_CASES)
def test_speculators_checkpoint(name, target, monkeypatch):
    folder, meta, expected = read_case(name)
    tol = meta["tolerances"]
    model = load_draft(folder / "draft", target=target)
    check_config(model.config, meta["expected_config"])
    if model.config.reduced_vocab:
        assert torch.equal(model.draft_to_target_ids, expected["draft_to_target_ids"])
    check_capture(target, model.config, expected, tol)
    check_blocks(model, expected, tol)
    check_drafter(name, model, expected, tol, expected["greedy_logits"],
                  expected.get("greedy_confidence_logits"))
    if not model.config.reduced_vocab:  # dspark's trainer trains full-vocabulary drafts only
        check_trainer(model, target, expected, tol, monkeypatch)


def _eps_times_100(model):
    model.config.rms_norm_eps *= 100


def _weight_nudge(model):
    with torch.no_grad():
        model.norm.weight.mul_(1 + 1e-4)


@pytest.mark.parametrize("perturb", [_eps_times_100, _weight_nudge], ids=["rms-norm-eps-x100", "norm-weight-1e-4"])
def test_a_slightly_wrong_draft_fails_the_fixtures(perturb, target):
    """The float32 tolerances (about ten times the observed error, README) have teeth: a draft read
    with its RMSNorm epsilon 100 times too large, or its final norm's weight off by one part in 10^4,
    fails."""
    folder, meta, expected = read_case("speculators-vanilla")
    model = load_draft(folder / "draft", target=target)
    perturb(model)
    with pytest.raises(AssertionError, match="block_hidden"):
        check_blocks(model, expected, meta["tolerances"])


@pytest.mark.parametrize("name", DEEPSPEC_CASES)
def test_deepspec_checkpoint(name, target):
    folder, meta, expected = read_case(name)
    tol = meta["tolerances"]
    model = load_draft(folder / "draft")  # DeepSpec checkpoints are whole: no target needed
    check_config(model.config, meta["expected_config"])
    check_capture(target, model.config, expected, tol)
    check_blocks(model, expected, tol)
    # DeepSpec's markov_prev_tokens are its greedy chain: corrected / confidence logits are the greedy ones
    check_drafter(name, model, expected, tol, expected["corrected_logits"], expected.get("confidence_logits"))
    check_decode_loop(model, target, meta, expected)


def check_decode_loop(model, target, meta, expected):
    """The engine's greedy decoding (scheduler off = DeepSpec's confidence threshold 0) against the
    evaluator's ``generate_one_sample``: same output, accept lengths and drafted blocks. The engine
    stops once the limit is committed (the prefill's token included); the evaluator counts only its
    rounds' tokens, so it may verify one more round whose tokens the limit cuts."""
    engine = LLMEngine(target, model, EngineConfig(max_batch=1, cuda_graphs=False))
    seq = engine.sequences[engine.add_request(Request(expected["input_ids"], meta["decode"]["max_new_tokens"]))]
    rounds = []  # (anchor position, drafts) of each next round, as the step that drafted it left them
    while engine.has_unfinished():
        engine.step()
        state = engine.runner.state
        rounds.append((int(state.anchor_pos[0]), state.draft_tokens[0].tolist()))
    result = seq
    assert result.output_ids == expected["decode_output_ids"].tolist()
    ours, accept = result.stats.accept_lengths, expected["decode_accept_lengths"].tolist()
    assert len(accept) == meta["decode"]["rounds"] and len(ours) in (len(accept), len(accept) - 1)
    assert ours[:-1] == accept[:len(ours) - 1]
    rounds = rounds[:len(ours)]  # the last step drafted a round that never ran
    assert [p for p, _ in rounds] == expected["decode_anchor_positions"][:len(ours)].tolist()
    assert [d for _, d in rounds] == expected["decode_draft_tokens"][:len(ours)].tolist()


# ---- what else the peers' checkpoints need ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["speculators-markov-rank0", "speculators-dflash"])
def test_rank0_and_dflash_drafters_decode_losslessly(name, target):
    draft = load_draft(PEERS / name / "draft", target=target)
    assert draft.markov_head is None
    prompt = read_case(name)[2]["input_ids"][:12].tolist()
    decoder = SpeculativeDecoder.from_models(target, draft, scheduler="off")
    result = decoder.generate(prompt, max_new_tokens=32, eos_token_id=[])
    assert result.token_ids == _greedy(target, prompt, 32)
    sampled = SamplingParams(temperature=0.8, top_k=-1, seed=3)
    first = decoder.generate(prompt, max_new_tokens=16, sampling=sampled).token_ids
    assert decoder.generate(prompt, max_new_tokens=16, sampling=sampled).token_ids == first


def test_speculators_checkpoint_needs_its_target(target, tmp_path):
    draft = PEERS / "speculators-vanilla" / "draft"
    with pytest.raises(ValueError, match=r"load_draft: checkpoint .* omits \['embed_tokens.weight', 'lm_head.weight'\]"
                                         r".* pass target= .*its config names the verifier 'target'"):
        load_draft(draft)
    with pytest.raises(TypeError, match="load_draft: target must be a Hugging Face model or its directory, got int"):
        load_draft(draft, target=3)
    with pytest.raises(ValueError, match="check_target_compatible: hidden size mismatch"):
        load_draft(draft, target=tiny_qwen3_target(vocab_size=100))
    # a directory works as well as the loaded model; a reduced vocabulary takes its rows of the target's head
    reduced = PEERS / "speculators-reduced-vocab" / "draft"
    from_dir, from_model = load_draft(reduced, target=PEERS / "target"), load_draft(reduced, target=target)
    for name, tensor in from_model.state_dict().items():
        assert torch.equal(from_dir.state_dict()[name], tensor), name
    assert torch.equal(from_model.lm_head.weight, target.lm_head.weight[from_model.draft_to_target_ids])
    assert torch.equal(from_model.embed_tokens.weight, target.get_input_embeddings().weight)
    # re-saved by dspark, the checkpoint is whole and loads without the target
    whole = load_draft(save_draft(from_model, tmp_path / "whole"))
    assert torch.equal(whole.lm_head.weight, from_model.lm_head.weight)


def test_speculators_defaults_for_missing_keys(target, tmp_path):
    """speculators' config defaults ``enable_confidence_head`` and ``confidence_head_with_markov`` to true."""
    copy = shutil.copytree(PEERS / "speculators-vanilla" / "draft", tmp_path / "draft")
    config = json.loads((copy / "config.json").read_text())
    del config["enable_confidence_head"], config["confidence_head_with_markov"]
    (copy / "config.json").write_text(json.dumps(config))
    loaded = load_draft(copy, target=target)
    assert loaded.config.enable_confidence_head and loaded.config.confidence_head_with_markov
    assert loaded.confidence_weight.shape == (64 + 8,)


def _keys(d: dict, prefix: str = "") -> set[str]:
    """Every key of a config, nested objects (and the first proposal method) spelled as paths."""
    out = set()
    for key, value in d.items():
        if key in HF_DEFAULTED:
            continue
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= _keys(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out |= _keys(value[0], f"{prefix}{key}[].")
    return out


@pytest.mark.parametrize("fmt, peer_case", [("speculators", "speculators-vanilla"), ("deepspec", "deepspec-gated")])
def test_dspark_output_carries_every_key_the_peers_write(fmt, peer_case, target, tmp_path):
    """A draft trained by dspark (and a peer checkpoint re-saved by dspark) carries every config key
    of the peer's own checkpoint but Hugging Face's defaulted ones, e.g. DeepSpec's required
    ``num_anchors``, and re-saving it changes nothing."""
    peer_config = json.loads((PEERS / peer_case / "draft" / "config.json").read_text())
    config = trainer.draft_config(target.config, mask_token_id=99, block_size=5, markov_rank=8,
                                  layer_type="sliding_attention", sliding_window=2048,
                                  verifier={"name_or_path": str(PEERS / "target"), "architectures": ["Qwen3ForCausalLM"]})
    own = save_draft(trainer.new_draft(target, config), tmp_path / "own", format=fmt)
    resaved = save_draft(load_draft(PEERS / peer_case / "draft", target=target), tmp_path / "resaved", format=fmt)
    for directory in (own, resaved):
        written = json.loads((directory / "config.json").read_text())
        missing = _keys(peer_config) - _keys(written)
        assert not missing, f"{directory.name}: dspark's {fmt} config lacks {sorted(missing)}"
        assert load_draft(directory).config.to_dict() == load_draft(save_draft(load_draft(directory), tmp_path / "again",
                                                                               format=fmt)).config.to_dict()


def test_entry_points_give_the_draft_its_target(target, capsys):
    """``dspark.generate`` and ``dspark generate`` load a speculators 0.9 draft with their target."""
    draft, prompt = PEERS / "speculators-gated" / "draft", [5, 17, 42, 8, 61]
    plain = _greedy(target, prompt, 12)
    assert dspark.generate(str(PEERS / "target"), str(draft), prompt, max_new_tokens=12, ignore_eos=True).token_ids == plain
    assert dspark.generate(target, str(draft), prompt, max_new_tokens=12, ignore_eos=True).token_ids == plain
    status = main(["generate", "--target", str(PEERS / "target"), "--draft", str(draft), "--prompt-ids",
                   ",".join(map(str, prompt)), "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu", "--json"])
    assert status == 0 and json.loads(capsys.readouterr().out)["generated_ids"] == plain
