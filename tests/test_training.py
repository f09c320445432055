"""Training: data, the DSpark objective (against hand computation), the batched training block
(its attention against the engine's), tiny CPU training runs of the drafter and of the demo target, and the
``dspark train`` command.

``tiny_pair`` (a saved tiny target with its own BPE tokenizer + a briefly trained draft) is shared
with test_calibration.py and test_eval.py.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib

import pytest
import torch
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target
from safetensors.torch import load_file
from test_engine import _greedy

import dspark.kernels as K
from dspark.cli import train as train_cli
from dspark.engine import SpeculativeDecoder
from dspark.model import load_draft
from dspark.training import data, target_lm, trainer
from dspark.training.data import pack_sequences, read_corpus, tokenize, train_tokenizer
from dspark.training.objective import dspark_loss, expected_accepted_length, position_weights
from dspark.training.trainer import TrainOptions, block_hidden, draft_config, draft_loss, new_draft, train_draft

TARGET = tiny_qwen3_target()
V = TARGET.config.vocab_size

CODE = """def add(a, b):
    return a + b


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5


for i in range(10):
    print(add(i, i + 1))
"""
TINY_SHAPE = target_lm.TargetShape(vocab_size=300, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                                   head_dim=8, intermediate_size=64)


def tiny_pair(directory, *, target_steps: int = 30, draft_steps: int = 20, block_size: int = 4):
    """Write ``directory/target`` (a tiny Qwen3 with a BPE tokenizer, trained ``target_steps`` steps
    on ``CODE``, float32) and ``directory/draft`` (a draft trained ``draft_steps`` steps on the same
    text); returns ``(target_dir, draft_dir)``."""
    tokenizer = train_tokenizer([CODE] * 4, TINY_SHAPE.vocab_size)
    rows = pack_sequences(tokenize(tokenizer, [CODE] * 8), 48, tokenizer.eos_token_id)
    target = target_lm.new_target(target_lm.target_config(TINY_SHAPE, tokenizer, 256), seed=0)
    target_lm.train_target(target, rows, TrainOptions(steps=target_steps, batch_size=4, lr=1e-2, log_every=10),
                           device="cpu")
    target_dir = target_lm.save_target(target, tokenizer, directory / "target", torch.float32)
    config = draft_config(target.config, mask_token_id=tokenizer.mask_token_id, block_size=block_size, markov_rank=8)
    options = TrainOptions(steps=draft_steps, batch_size=4, lr=3e-3, log_every=10)
    train_draft(target, rows, config, options, device="cpu", num_anchors=8, output=directory / "draft",
                save_dtype=torch.float32)
    return target_dir, directory / "draft"


# ---- data ---------------------------------------------------------------------------------------


def test_read_corpus_text_directory_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("second")
    (tmp_path / ".hidden").write_text("skipped")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00")
    assert read_corpus(str(tmp_path)) == ["first", "second"]
    assert read_corpus(str(tmp_path / "a.txt")) == ["first"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "plain"}\n\n{"turns": ["q1", "q2"]}\n')
    assert read_corpus(str(jsonl)) == ["plain", "q1\n\nq2"]


@pytest.mark.parametrize("content, message", [('{"other": 1}\n', "'text'"), ("not json\n", "not valid JSON")])
def test_read_corpus_rejects_bad_jsonl(tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_corpus(str(bad))


def test_read_corpus_rejects_unknown_spec(tmp_path):
    with pytest.raises(ValueError, match="read_corpus: spec"):
        read_corpus(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="split must be one of"):
        read_corpus("stdlib:everything")


def test_stdlib_split_is_deterministic_and_partitions(tmp_path):
    root = tmp_path / "lib"
    names = [f"pkg{i // 10}/mod{i}.py" for i in range(200)] + ["site-packages/x.py"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")
    splits = {s: {p.relative_to(root).as_posix() for p in data.stdlib_files(s, root)} for s in data.STDLIB_SPLITS}
    assert set().union(*splits.values()) == set(names[:-1])  # site-packages excluded
    assert sum(len(s) for s in splits.values()) == 200  # disjoint
    for split, files in splits.items():
        for name in files:
            bucket = zlib.crc32(name.encode()) % 50
            assert split == ("test" if bucket < 2 else "valid" if bucket < 4 else "train")


def test_python_corpus_adds_the_packages_and_keeps_the_held_out_files_out(tmp_path):
    stdlib, packages = tmp_path / "lib", tmp_path / "site-packages"
    names = [f"pkg{i // 10}/mod{i}.py" for i in range(200)]
    for i, name in enumerate(names):
        for root in (stdlib, packages):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(f"x = {i}\n")  # a package file here is a copy of the library's
    (packages / "vendored_other.py").write_text("y = 2\n")
    test_texts = {p.read_text() for p in data.stdlib_files("test", stdlib)}
    assert test_texts
    train, valid = (data.python_files(s, stdlib, [packages]) for s in ("train", "valid"))
    assert not set(train) & set(valid)
    # every library file of the split, and every package file but the copies of held-out library files
    assert {p for p in train if p.is_relative_to(stdlib)} == set(data.stdlib_files("train", stdlib))
    assert packages / "vendored_other.py" in train + valid
    assert not test_texts & {p.read_text() for p in train + valid}
    assert len(train) + len(valid) == 2 * 200 + 1 - 2 * len(test_texts)
    with pytest.raises(ValueError, match="python_files: split must be 'train' or 'valid'"):
        data.python_files("test", stdlib, [packages])


def test_tokenizer_sample_spreads_over_the_corpus():
    texts = [f"{i:03d}" * 10 for i in range(100)]  # 30 characters each, 3000 in all
    assert target_lm.tokenizer_sample(texts, 10_000) == texts
    sample = target_lm.tokenizer_sample(texts, 600)  # every 5th
    assert sample == texts[::5] and sum(map(len, sample)) == 600


def test_stdlib_corpus_has_held_out_files():
    counts = {s: len(data.stdlib_files(s)) for s in data.STDLIB_SPLITS}
    total = sum(counts.values())
    assert total > 200 and 0.01 < counts["test"] / total < 0.08 and 0.01 < counts["valid"] / total < 0.08
    prompts = data.heldout_prompts("test", max_chars=300)
    # cut before the whitespace that ends a line: a prefix of its file followed there by whitespace
    root = data.stdlib_root()
    assert prompts and all(len(p["text"]) < 300 and p["text"] == p["text"].rstrip() for p in prompts)
    for p in prompts:
        text = (root / p["file"]).read_text()
        assert text.startswith(p["text"]) and text[len(p["text"])].isspace()
    assert all(data.stdlib_split(p["file"]) == "test" for p in prompts)


def test_tokenizer_round_trip_and_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = train_tokenizer([CODE], 300)
    assert tokenizer.eos_token_id == 0 and tokenizer.mask_token_id == 1 and len(tokenizer) <= 300
    text = "def f(x):\n    return x  # ünïcödé ✓\n"
    assert tokenizer.decode(tokenize(tokenizer, [text])[0]) == text
    data.save_tokenizer(tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["chat_template"] == data.CHAT_TEMPLATE
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenize(loaded, [CODE]) == tokenize(tokenizer, [CODE])
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer([CODE], 100)


def test_pack_sequences_layout():
    rows = pack_sequences([[5, 6, 7], [8], [9, 10]], 4, eos_id=0)
    assert rows.tolist() == [[5, 6, 7, 0], [8, 0, 9, 10]]  # the trailing EOS does not fill a row
    with pytest.raises(ValueError, match="fewer than one row"):
        pack_sequences([[1]], 8, eos_id=0)


def test_prompt_records(tmp_path):
    file = data.write_prompts(tmp_path / "p.jsonl", [{"text": "abc"}, {"turns": ["hello", "again"]}])
    records = data.read_prompts(str(file))
    tokenizer = train_tokenizer([CODE, "abc hello"], 300)
    assert data.prompt_token_ids(tokenizer, records[0]) == tokenize(tokenizer, ["abc"])[0]
    assert data.prompt_token_ids(tokenizer, records[1]) == tokenize(tokenizer, ["hello"])[0]  # no chat template
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<bot>"
    assert tokenizer.decode(data.prompt_token_ids(tokenizer, records[1])) == "<user>hello<bot>"
    with pytest.raises(ValueError, match="read_prompts: prompt file '.*none.jsonl' not found"):
        data.read_prompts(str(tmp_path / "none.jsonl"))
    with pytest.raises(ValueError, match="read_prompts: prompts must be stdlib:<split> or a .jsonl file"):
        data.read_prompts(str(tmp_path))


def test_demo_pair_reports_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="incomplete.*build_demo_pair"):
        data.demo_pair(tmp_path)


# ---- the objective ------------------------------------------------------------------------------


def test_position_weights():
    assert torch.allclose(position_weights(4, 4.0), torch.tensor([math.exp(-k / 4) for k in range(4)]))
    assert torch.allclose(position_weights(4, 2.0, sample_from_anchor=False),
                          torch.tensor([0.0, 1.0, math.exp(-1 / 2), math.exp(-2 / 2)]))
    with pytest.raises(ValueError, match="position_weights: gamma"):
        position_weights(4, 0.0)


def _hand_loss(draft, target, conf, weights, greedy_confidence):
    """The objective written out with explicit loops (float64)."""
    rows, n, v = draft.shape
    ce_sum = tv_sum = bce_sum = bce_norm = 0.0
    acceptance, greedy = [0.0] * n, [0.0] * n
    for r in range(rows):
        passed = 1.0  # earlier drafting slots of this block all matched
        for k in range(n):
            zq = [math.exp(float(x)) for x in draft[r, k]]
            zp = [math.exp(float(x)) for x in target[r, k]]
            q = [x / sum(zq) for x in zq]
            p = [x / sum(zp) for x in zp]
            label = max(range(v), key=lambda i: p[i])
            ce = -math.log(q[label])
            tv = 0.5 * sum(abs(a - b) for a, b in zip(q, p))
            match = float(max(range(v), key=lambda i: q[i]) == label)
            c = match if greedy_confidence else 1 - tv
            s = 1 / (1 + math.exp(-float(conf[r, k])))
            bce = -(c * math.log(s) + (1 - c) * math.log(1 - s))
            w = float(weights[k])
            w_bce = w * passed if greedy_confidence else w
            ce_sum, tv_sum = ce_sum + w * ce, tv_sum + w * tv
            bce_sum, bce_norm = bce_sum + w_bce * bce, bce_norm + w_bce
            if w > 0:
                passed *= match
            acceptance[k] += (1 - tv) / rows
            greedy[k] += match / rows
    norm = rows * float(weights.sum())
    ce, tv, bce = ce_sum / norm, tv_sum / norm, bce_sum / bce_norm
    return 0.1 * ce + 0.9 * tv + 1.0 * bce, ce, tv, bce, acceptance, greedy


@pytest.mark.parametrize("sample_from_anchor, greedy_confidence",
                         [(True, False), (False, False), (True, True), (False, True)])
def test_dspark_loss_matches_hand_computation(sample_from_anchor, greedy_confidence):
    g = torch.Generator().manual_seed(3)
    draft = torch.randn(3, 4, 6, generator=g) * 2
    target = torch.randn(3, 4, 6, generator=g) * 2
    draft[0, :2] = target[0, :2]  # exact matches: TV 0, and a block whose first two slots are accepted
    conf = torch.randn(3, 4, generator=g)
    weights = position_weights(4, 4.0, sample_from_anchor)
    out = dspark_loss(draft, target, conf, weights, greedy_confidence=greedy_confidence)
    loss, ce, tv, bce, acceptance, greedy = _hand_loss(draft, target, conf, weights, greedy_confidence)
    for got, want in ((out.loss, loss), (out.ce, ce), (out.tv, tv), (out.bce, bce)):
        assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-6)
    slots = slice(0, 4) if sample_from_anchor else slice(1, 4)  # slot 0 drafts nothing without SFA
    assert out.acceptance.tolist() == pytest.approx(acceptance[slots], abs=1e-6)
    assert out.greedy_acceptance.tolist() == pytest.approx(greedy[slots])


def test_dspark_loss_gradients_and_no_confidence():
    draft = torch.randn(2, 3, 5, requires_grad=True)
    target = torch.randn(2, 3, 5)
    out = dspark_loss(draft, target, None, position_weights(3))
    assert float(out.bce) == 0.0
    out.loss.backward()
    assert draft.grad is not None and draft.grad.abs().sum() > 0


def test_dspark_loss_rejects_bad_input():
    with pytest.raises(ValueError, match="dspark_loss: target_logits must have shape"):
        dspark_loss(torch.randn(2, 3, 5), torch.randn(2, 3, 4), None, position_weights(3))
    with pytest.raises(ValueError, match="dspark_loss: weights must have shape"):
        dspark_loss(torch.randn(2, 3, 5), torch.randn(2, 3, 5), None, position_weights(4))
    with pytest.raises(TypeError, match="dspark_loss: draft_logits must have dtype"):
        dspark_loss(torch.zeros(2, 3, 5, dtype=torch.int64), torch.randn(2, 3, 5), None, position_weights(3))


def test_expected_accepted_length():
    assert expected_accepted_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_accepted_length(torch.ones(7)) == pytest.approx(8.0)


# ---- the training block: inference's forward, training's attention ----------------------------------


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 8), (False, 3)])
@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_training_attention_sees_what_inference_attention_sees(causal, window, attention):
    """The draft's forward is one (``draft_runner``) in both modes but for the attention op: over
    the same keys, training's (a row's line ``[context; blocks]`` under ``training_mask`` /
    ``training_block_mask``) equals the engine's ``cached_attention`` of each block over its own
    cache line (context ``< p``, the window, the block)."""
    b, s, n, heads, kv_heads, d = 2, 30, 5, 4, 2, 8
    anchors = torch.tensor([[1, 7, 12, 25], [3, 9, 10, 20]])  # window 8: the far anchors cut context
    a = anchors.shape[1]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(b, heads, a * n, d, generator=g)
    k, v = (torch.randn(b, kv_heads, s + a * n, d, generator=g) for _ in range(2))
    make_mask = trainer.training_mask if attention == "dense" else trainer.training_block_mask
    out = trainer._training_attention(q, k, v, make_mask(anchors, s, n, causal, window))
    # inference: one cache line per block, its context rows then its block at positions p .. p+N-1
    lines = torch.zeros(2, b * a, s + n, kv_heads, d)
    for line, (row, i) in enumerate((row, i) for row in range(b) for i in range(a)):
        p = int(anchors[row, i])
        for cache, keys in zip(lines, (k, v)):
            cache[line, :p] = keys[row, :, :p].transpose(0, 1)
            cache[line, p:p + n] = keys[row, :, s + i * n:s + (i + 1) * n].transpose(0, 1)
    flat = anchors.reshape(-1).int()
    expected = K.cached_attention(q.view(b, heads, a, n, d).permute(0, 2, 3, 1, 4).reshape(-1, heads, d), *lines,
                                  torch.arange(b * a, dtype=torch.int32), flat,
                                  torch.arange(0, (b * a + 1) * n, n, dtype=torch.int32), n, causal=causal,
                                  window_starts=None if window is None else (flat - window).clamp(min=0))
    torch.testing.assert_close(out.transpose(1, 2).reshape(-1, heads, d), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_types", [("full_attention", "sliding_attention"), ("sliding_attention",)])
def test_block_sparse_training_attention_equals_the_dense_mask(layer_types):
    """FlexAttention over the ``BlockMask`` (the GPU's training attention) computes what SDPA over the
    dense ``training_mask`` does: forward on the CPU (FlexAttention has no CPU backward), forward and
    gradients on a GPU."""
    cfg = tiny_draft_config(TARGET.config, block_size=5, layer_types=layer_types)
    ids = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(2))
    context, _ = trainer.target_states(TARGET, ids, cfg.capture_layer_ids)
    anchors = torch.tensor([[1, 7, 12, 25], [3, 9, 10, 20]])
    block_ids = torch.full((2, 4, 5), cfg.mask_token_id)
    block_ids[..., 0] = ids.gather(1, anchors)
    model = random_draft(cfg, target=TARGET)
    with torch.no_grad():
        dense = block_hidden(model, context, block_ids, anchors, attention="dense")
        flex = block_hidden(model, context, block_ids, anchors, attention="flex")
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention must be"):
        block_hidden(model, context, block_ids, anchors, attention="sparse")
    with pytest.raises(ValueError, match="trains on a GPU only"):
        block_hidden(model, context, block_ids, anchors, attention="flex")  # gradients on: the CPU cannot


def _cuda_blocks():
    """A sliding + full draft config and a CUDA target with heads of 16 dims (FlexAttention's
    smallest on a GPU), with a batch's captured context, anchors and blocks (the CUDA training tests'
    inputs)."""
    target = tiny_qwen3_target(hidden_size=64, head_dim=16).cuda()
    cfg = tiny_draft_config(target.config, block_size=5, layer_types=("full_attention", "sliding_attention"))
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(3)).cuda()
    context, _ = trainer.target_states(target, ids, cfg.capture_layer_ids)
    anchors = torch.tensor([[1, 7, 12, 25], [3, 9, 10, 30]], device="cuda")
    block_ids = torch.full((2, 4, 5), cfg.mask_token_id, device="cuda")
    block_ids[..., 0] = ids.gather(1, anchors)
    return cfg, target, ids, context, anchors, block_ids


@pytest.mark.gpu
def test_cuda_block_sparse_training_gradients_equal_the_dense_mask():
    cfg, target, ids, context, anchors, block_ids = _cuda_blocks()
    grads = []
    for attention in ("dense", "flex"):
        model = random_draft(cfg, target=target).cuda().requires_grad_(True)
        hidden = block_hidden(model, context, block_ids, anchors, attention=attention)
        hidden.square().sum().backward()
        grads.append((hidden.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
    assert len(grads[0][1]) > 10  # the backbone's parameters got gradients
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-4, rtol=1e-4)
    for flex, dense in zip(grads[1][1], grads[0][1], strict=True):
        torch.testing.assert_close(flex, dense, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_cuda_training_forward_under_autocast_is_the_bf16_engine_forward():
    """A GPU step's draft forward (bf16 autocast over the fp32 draft; FlexAttention; the kernels'
    PyTorch reference, since a gradient flows) stays within bf16 rounding of the engine's forward
    (Triton) of the same weights in bf16, its gradients are finite, and ``train_draft`` runs there."""
    cfg, target, ids, context, anchors, block_ids = _cuda_blocks()
    model = random_draft(cfg, target=target).cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = block_hidden(model, context, block_ids, anchors)
    hidden.float().square().sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) > 10 and all(torch.isfinite(g).all() for g in grads)
    half = random_draft(cfg, target=target).to("cuda", torch.bfloat16)
    half.load_state_dict(model.state_dict())
    for b in range(2):
        for a in range(4):
            p = int(anchors[b, a])
            expected = half.forward_block(half.new_cache(), context[b, :p].bfloat16(), int(ids[b, p]), p)
            torch.testing.assert_close(hidden[b, a].float(), expected.float(), atol=0.1, rtol=0.05)
    _, losses = train_draft(target, _rows(8, 32).cuda(), cfg, TrainOptions(steps=3, batch_size=4, log_every=1),
                            device="cuda", num_anchors=4)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_training_mask_small_case():
    mask = trainer.training_mask(torch.tensor([[2, 4]]), seq_len=5, block_size=2, causal=True, window=1)
    expected = torch.tensor([
        # ctx 0..4        block a0   block a1
        [0, 1, 0, 0, 0, 1, 0, 0, 0],  # anchor 2 slot 0: context [1, 2) (window 1), itself
        [0, 1, 0, 0, 0, 1, 1, 0, 0],  # anchor 2 slot 1: causal inside the block
        [0, 0, 0, 1, 0, 0, 0, 1, 0],
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0], expected)
    full = trainer.training_mask(torch.tensor([[2]]), seq_len=5, block_size=2, causal=False, window=None)
    assert full[0].tolist() == [[True, True, False, False, False, True, True]] * 2


def test_sample_anchors():
    anchors = trainer.sample_anchors(3, 20, 6, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 6)
    assert bool((anchors[:, 1:] > anchors[:, :-1]).all()) and int(anchors.min()) >= 1 and int(anchors.max()) <= 16
    assert trainer.sample_anchors(2, 10, 100, 4).shape == (2, 6)  # only 6 anchors fit
    with pytest.raises(ValueError, match="sample_anchors: seq_len"):
        trainer.sample_anchors(1, 4, 2, 4)


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_draft_loss_trains_each_slot_on_its_target_row(monkeypatch, sample_from_anchor):
    """Slot k of the block at p learns the target's row p+k (SFA) or p+k-1, with that row's token as
    the Markov head's previous token; without SFA slot 0 (which drafts nothing) gets the anchor, as
    speculators' trainer gives it."""
    cfg = draft_config(TARGET.config, mask_token_id=V - 1, block_size=3, markov_rank=4,
                       sample_from_anchor=sample_from_anchor)
    model = new_draft(TARGET, cfg)
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(2))
    seen = {}
    monkeypatch.setattr(trainer, "dspark_loss", lambda *args, **kwargs: seen.setdefault("args", args))

    def base_logits(m, hidden, prev):
        seen["prev"] = prev
        return m.lm_head(hidden).float()

    monkeypatch.setattr(trainer, "markov_logits", base_logits)
    generator = torch.Generator().manual_seed(5)
    anchors = trainer.sample_anchors(2, 12, 4, 3, torch.Generator().manual_seed(5))
    draft_loss(model, TARGET, ids, 4, position_weights(3, 4.0, sample_from_anchor), generator)
    rows = (anchors[:, :, None] + torch.arange(3) - (0 if sample_from_anchor else 1)).clamp(min=0)
    full = TARGET(input_ids=ids).logits
    expected = torch.stack([full[b, rows[b]] for b in range(2)]).reshape(-1, 3, V)
    torch.testing.assert_close(seen["args"][1], expected, atol=1e-5, rtol=1e-5)
    prev_rows = torch.maximum(rows, anchors[:, :, None])
    assert torch.equal(seen["prev"], torch.stack([ids[b, prev_rows[b]] for b in range(2)]).reshape(-1, 3))
    assert torch.equal(seen["prev"][:, 0], ids.gather(1, anchors).reshape(-1))


def test_regenerate_continues_rows_greedily():
    rows = torch.randint(0, V, (6, 16), generator=torch.Generator().manual_seed(4))
    out = trainer.regenerate(TARGET, rows, 3, prompt_tokens=5, batch_size=2)
    assert out.shape == (3, 16)
    assert all(any(torch.equal(o[:5], r[:5]) for r in rows) for o in out)
    with torch.no_grad():
        assert torch.equal(TARGET(input_ids=out).logits[:, 4:-1].argmax(-1), out[:, 5:])
    with pytest.raises(ValueError, match="regenerate: prompt_tokens"):
        trainer.regenerate(TARGET, rows, 3, prompt_tokens=16)


@pytest.mark.parametrize("backprop", [False, True])
def test_confidence_loss_reaches_the_backbone_only_with_backprop(backprop):
    """Two drafts differing only in their confidence heads get the same backbone gradients when the
    confidence inputs are detached (the default), different ones otherwise."""
    cfg = draft_config(TARGET.config, mask_token_id=V - 1, block_size=3, markov_rank=4)
    ids = _rows(2, 16)
    grads = []
    for seed in (1, 2):
        model = new_draft(TARGET, cfg)
        with torch.no_grad():
            model.confidence_head.proj.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
        loss = draft_loss(model, TARGET, ids, 4, position_weights(3), torch.Generator().manual_seed(0),
                          confidence_backprop=backprop).loss
        loss.backward()
        assert model.confidence_head.proj.weight.grad.abs().sum() > 0
        grads.append(torch.cat([model.fc.weight.grad.flatten(), model.markov_head.markov_w1.weight.grad.flatten()]))
    assert torch.allclose(grads[0], grads[1]) != backprop


# ---- training runs ------------------------------------------------------------------------------


def _rows(n=24, s=32, seed=0):
    return torch.randint(0, V - 1, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_training_reduces_the_loss(head_type):
    cfg = draft_config(TARGET.config, mask_token_id=V - 1, block_size=4, markov_rank=8, markov_head_type=head_type)
    options = TrainOptions(steps=30, batch_size=4, lr=3e-3, log_every=1)
    held_out = _rows(4, 32, seed=9)
    weights = position_weights(4)

    def loss_of(model):
        with torch.no_grad():
            return draft_loss(model, TARGET, held_out, 8, weights, torch.Generator().manual_seed(1))

    before = loss_of(new_draft(TARGET, cfg, seed=options.seed))
    model, losses = train_draft(TARGET, _rows(), cfg, options, device="cpu", num_anchors=8)
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    after = loss_of(model)
    assert float(after.loss) < 0.9 * float(before.loss)
    assert float(after.tv) < float(before.tv) and float(after.bce) < float(before.bce)
    assert torch.equal(model.embed_tokens.weight, TARGET.get_input_embeddings().weight)  # frozen copies
    assert torch.equal(model.lm_head.weight, TARGET.get_output_embeddings().weight)


def test_dflash_ablation_is_saved_at_rank_0(tmp_path):
    """``markov_rank=0``: no Markov head and no confidence head, saved as rank 0 (as the peers write
    DFlash-style drafters); it trains, loads and decodes losslessly."""
    cfg = draft_config(TARGET.config, mask_token_id=V - 1, block_size=4, markov_rank=0)
    assert cfg.markov_rank == 0 and not cfg.enable_confidence_head
    model, _ = train_draft(TARGET, _rows(), cfg, TrainOptions(steps=5, batch_size=4), device="cpu",
                           num_anchors=8, output=tmp_path, save_dtype=torch.float32)
    assert model.markov_head is None and not torch.equal(model.fc.weight, new_draft(TARGET, cfg).fc.weight)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["markov_rank"] == 0 and not config["enable_confidence_head"]
    assert not any(name.startswith("markov_head.") for name in load_file(str(tmp_path / "model.safetensors")))
    loaded = load_draft(tmp_path)
    bias, _ = loaded.markov_bias(torch.randn(3, cfg.hidden_size), torch.tensor([1, 2, 3]))
    assert bias.shape == (3, V) and not bias.any()
    decoder = SpeculativeDecoder.from_models(TARGET, loaded)
    prompt = [3, 14, 15, 92, 65]
    assert decoder.generate(prompt, max_new_tokens=20, eos_token_id=[]).token_ids == _greedy(TARGET, prompt, 20)


def test_trained_checkpoint_runs_losslessly_in_the_engine(tmp_path):
    cfg = draft_config(TARGET.config, mask_token_id=V - 1, block_size=4, markov_rank=8)
    train_draft(TARGET, _rows(), cfg, TrainOptions(steps=5, batch_size=4, save_every=2), device="cpu",
                num_anchors=8, output=tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["dtype"] == "bfloat16"
    draft = load_draft(tmp_path, dtype=torch.float32)
    decoder = SpeculativeDecoder.from_models(TARGET, draft)
    prompt = [3, 14, 15, 92, 65]
    assert decoder.generate(prompt, max_new_tokens=20, eos_token_id=[]).token_ids == _greedy(TARGET, prompt, 20)


def test_train_options_and_schedule():
    options = TrainOptions(steps=100, warmup=0.1)
    assert options.lr_factor(0.05) == pytest.approx(0.5) and options.lr_factor(0.1) == pytest.approx(1.0)
    assert options.lr_factor(0.55) == pytest.approx(0.5) and options.lr_factor(1.0) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="TrainOptions: steps"):
        TrainOptions(steps=0)
    with pytest.raises(ValueError, match="TrainOptions: warmup"):
        TrainOptions(warmup=1.5)


def test_config_helpers():
    assert trainer.default_capture_layer_ids(28) == [2, 14, 25]
    assert trainer.default_capture_layer_ids(4) == [1, 2, 3]
    tokenizer = train_tokenizer([CODE], 300)
    assert trainer.resolve_mask_token_id(tokenizer, 300) == tokenizer.mask_token_id
    assert trainer.resolve_mask_token_id(tokenizer, 300, explicit=7) == 7
    with pytest.raises(ValueError, match="mask_token_id must be in"):
        trainer.resolve_mask_token_id(tokenizer, 300, explicit=300)
    with pytest.raises(ValueError, match="draft_config: markov_rank"):
        draft_config(TARGET.config, mask_token_id=0, markov_rank=-1)


# ---- the demo target ------------------------------------------------------------------------------


def test_target_lm_training_reduces_loss_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = train_tokenizer([CODE], TINY_SHAPE.vocab_size)
    rows = pack_sequences(tokenize(tokenizer, [CODE] * 20), 32, tokenizer.eos_token_id)
    model = target_lm.new_target(target_lm.target_config(TINY_SHAPE, tokenizer, 128))
    with torch.no_grad():
        before = float(target_lm.lm_loss(model, rows[:4]))
    target_lm.train_target(model, rows, TrainOptions(steps=25, batch_size=4, lr=1e-2), device="cpu")
    with torch.no_grad():
        assert float(target_lm.lm_loss(model, rows[:4])) < 0.7 * before
    target_lm.save_target(model, tokenizer, tmp_path, torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(loaded(input_ids=rows[:2]).logits, model(input_ids=rows[:2]).logits)
    assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id
    assert AutoTokenizer.from_pretrained(tmp_path).mask_token_id == tokenizer.mask_token_id
    with pytest.raises(ValueError, match="target_config: the tokenizer has"):
        target_lm.target_config(target_lm.TargetShape(64, 32, 2, 4, 2, 8, 64), tokenizer, 128)


# ---- dspark train ---------------------------------------------------------------------------------


def _train_args(**overrides):
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    required = ["--target", "T", "--data", "D", "--output", "O"]  # placeholders each test overrides as it needs
    args = parser.parse_args(required)
    vars(args).update(overrides)
    return args


def test_train_command(tmp_path, capsys):
    target_dir, _ = tiny_pair(tmp_path, target_steps=1, draft_steps=1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CODE * 6)
    args = _train_args(target=str(target_dir), data=str(corpus), output=str(tmp_path / "cli_draft"), steps=4,
                       batch_size=2, seq_len=32, anchors=4, block_size=3, markov_rank=4, head_type="gated",
                       corpus_rows=3, regenerate=2, device="cpu")
    assert train_cli.run(args) == 0
    draft = load_draft(tmp_path / "cli_draft")
    assert draft.config.markov_head_type == "gated" and draft.config.block_size == 3
    assert draft.config.mask_token_id == 1  # the tokenizer's <|MASK|>
    out = capsys.readouterr().out
    assert "in 5 rows of 32" in out and "saved the draft" in out  # 3 corpus rows + 2 regenerated
    bad = _train_args(target=str(target_dir), data=str(tmp_path / "missing.txt"), output=str(tmp_path / "x"),
                      device="cpu")
    assert train_cli.run(bad) == 2
    assert "dspark train: read_corpus" in capsys.readouterr().err


def test_train_starts_from_a_drafts_weights_with_init_from(tmp_path, capsys):
    """``--init-from``: a new run starts from a checkpoint's weights (with learning rate 0 it writes
    them back unchanged); a draft of another shape, or with ``--resume``, is refused naming it."""
    from safetensors.torch import load_file

    target_dir, _ = tiny_pair(tmp_path, target_steps=1, draft_steps=1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CODE * 6)
    common = dict(target=str(target_dir), data=str(corpus), batch_size=2, seq_len=32, anchors=4, block_size=3,
                  markov_rank=4, corpus_rows=3, device="cpu")
    assert train_cli.run(_train_args(output=str(tmp_path / "first"), steps=3, **common)) == 0
    assert train_cli.run(_train_args(output=str(tmp_path / "again"), steps=1, lr=0.0, seed=7,
                                     init_from=str(tmp_path / "first"), **common)) == 0
    first, again = (load_file(tmp_path / d / "model.safetensors") for d in ("first", "again"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    fresh = tmp_path / "fresh"
    assert train_cli.run(_train_args(output=str(fresh), steps=1, lr=0.0, seed=7, **common)) == 0
    assert not torch.equal(load_file(fresh / "model.safetensors")["fc.weight"], first["fc.weight"])
    capsys.readouterr()
    other = dict(common, markov_rank=8)
    assert train_cli.run(_train_args(output=str(tmp_path / "x"), init_from=str(tmp_path / "first"), **other)) == 2
    err = capsys.readouterr().err
    assert f"--init-from {tmp_path / 'first'} is a draft of another shape: markov_rank 4 (this run: 8)" in err
    assert train_cli.run(_train_args(output=str(tmp_path / "first"), init_from=str(tmp_path / "first"),
                                     resume=True, **common)) == 2
    assert "--init-from starts a new run" in capsys.readouterr().err
    assert train_cli.run(_train_args(output=str(tmp_path / "y"), init_from=str(corpus), **common)) == 2
    assert f"--init-from {corpus}: expected a draft checkpoint directory (with a config.json), got a file" in \
        capsys.readouterr().err


def test_train_refuses_a_non_empty_output_unless_overwrite(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    assert train_cli.run(_train_args(output=str(tmp_path / "out"), device="cpu")) == 2
    assert "exists and is not empty: pass --overwrite" in capsys.readouterr().err
    status = train_cli.run(_train_args(output=str(tmp_path / "out" / "config.json"), device="cpu"))
    assert status == 2 and "is a file, not a directory" in capsys.readouterr().err
    # with --overwrite the output check passes and the next problem (a missing target) is reported
    missing = str(tmp_path / "T")
    assert train_cli.run(_train_args(target=missing, output=str(tmp_path / "out"), overwrite=True, device="cpu")) == 2
    assert f"load_target: target directory {missing!r} does not exist" in capsys.readouterr().err


def test_optimize_logs_the_last_step_and_ends_the_bar_at_100_percent():
    import io

    weight = torch.nn.Parameter(torch.ones(()))
    stream = io.StringIO()
    options = TrainOptions(steps=5, batch_size=2, log_every=2)
    losses = trainer.optimize(trainer.adamw([weight], options), lambda batch: ((weight - 3.0) ** 2, {}),
                              torch.zeros(4, 2, dtype=torch.long), options, device="cpu", stream=stream)
    assert len(losses) == 4  # steps 1, 2, 4 and the last, 5
    assert stream.getvalue().splitlines()[-1].startswith("train [####################] 100% step 5 loss")


def test_the_trainer_benchmark_runs_on_the_cpu(tmp_path, capsys):
    """``python -m dspark.bench.train`` (a tiny shape, the dense attention: FlexAttention trains on GPUs only)."""
    from dspark.bench import train as bench

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, tie_word_embeddings=False, capture=[0, 1])
    assert bench.main(["--out", str(tmp_path), "--shape", json.dumps(shape), "--vocab", "256", "--seq-lens", "48",
                       "--anchors", "4", "--attention", "dense", "--steps", "2", "--device", "cpu"]) == 0
    row = json.loads((tmp_path / "train.json").read_text())["rows"][0]
    assert row["tokens_per_s"] > 0 and row["tflops_per_step"] >= 0 and row["block_tokens"] == 4 * 7
    assert "| 48 | 4 | dense |" in (tmp_path / "train.md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--attention", "flex", "--device", "cpu"])
    assert "needs a GPU" in capsys.readouterr().err
