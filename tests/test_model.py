"""The DSpark draft model against plain re-computations of runtime.md §2-§4.

The references below are written independently of ``dspark.model`` (float64, explicit loops over
the training mask of runtime.md §2.5) so that the module code is checked, not re-used.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import gpu
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target

from dspark.model import DSparkConfig

TARGET = tiny_qwen3_target()
H, V = TARGET.config.hidden_size, TARGET.config.vocab_size


def make_draft(seed=0, **kw):
    return random_draft(tiny_draft_config(TARGET.config, **kw), seed, TARGET)


def context_states(model, length, seed=1):
    """Random stand-in for the concatenated captured target hidden states ``[length, m*H]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, model.config.num_capture_layers * H, generator=g)


# ---- plain reference of the backbone (runtime.md §2.2-§2.5) ------------------------------------


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta):
    """x [T, heads, d] rotated by rotate_half at integer positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference_block(model, context, anchor, p):
    """Full attention over [context 0..p-1 ; block p..p+N-1] with the training mask, float64."""
    cfg = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    eps, nh, nkv, d, n = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    c = _rms(context.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = w["embed_tokens.weight"][[anchor] + [cfg.mask_token_id] * (n - 1)]
    pos_all = torch.arange(p + n)
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        a = _rms(x, w[pre + "input_layernorm.weight"], eps)
        src = torch.cat([c, a])  # keys/values come from the context and the block
        q = _rope(_rms((a @ w[pre + "self_attn.q_proj.weight"].T).view(n, nh, d), w[pre + "self_attn.q_norm.weight"], eps),
                  pos_all[p:], cfg.rope_theta)
        k = _rope(_rms((src @ w[pre + "self_attn.k_proj.weight"].T).view(p + n, nkv, d), w[pre + "self_attn.k_norm.weight"], eps),
                  pos_all, cfg.rope_theta)
        v = (src @ w[pre + "self_attn.v_proj.weight"].T).view(p + n, nkv, d)
        window, causal = cfg.layer_window(i), cfg.layer_is_causal(i)
        visible = torch.zeros(n, p + n, dtype=torch.bool)
        for s in range(n):
            for j in range(p + n):
                if j < p:
                    visible[s, j] = window is None or j >= p - window
                else:
                    visible[s, j] = not causal or j - p <= s
        out = torch.empty(n, nh, d, dtype=torch.float64)
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = (q[:, head] @ k[:, kv].T) / math.sqrt(d)
            scores = scores.masked_fill(~visible, float("-inf"))
            out[:, head] = torch.softmax(scores, -1) @ v[:, kv]
        x = x + out.reshape(n, nh * d) @ w[pre + "self_attn.o_proj.weight"].T
        m = _rms(x, w[pre + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[pre + "mlp.gate_proj.weight"].T, m @ w[pre + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[pre + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)


ATTENTION_CASES = [
    pytest.param(["full_attention", "full_attention"], None, False, id="bidirectional"),
    pytest.param(["sliding_attention", "sliding_attention"], 5, False, id="causal-sliding"),
    pytest.param(["full_attention", "sliding_attention"], 4, False, id="mixed"),
    pytest.param(["sliding_attention", "full_attention"], 3, True, id="sliding-non-causal"),
    pytest.param(["sliding_attention", "sliding_attention"], 64, False, id="causal-window-past-the-context"),
]


@pytest.mark.parametrize("layer_types,window,non_causal", ATTENTION_CASES)
def test_forward_block_matches_reference(layer_types, window, non_causal):
    model = make_draft(layer_types=layer_types, sliding_window=window, sliding_window_non_causal=non_causal, block_size=5)
    p = 11
    context = context_states(model, p)
    cache = model.new_cache()
    hidden = model.forward_block(cache, context, 7, p)
    assert hidden.shape == (5, H) and hidden.dtype == torch.float32
    assert cache.length == p  # only the context is kept, never the block
    torch.testing.assert_close(hidden.double(), reference_block(model, context, 7, p), atol=2e-5, rtol=1e-5)


def test_causal_and_window_change_the_result():
    """Guards the reference itself: the mask options must matter on these shapes."""
    context = context_states(make_draft(), 11)
    outs = [reference_block(make_draft(layer_types=["sliding_attention"] * 2, sliding_window=w,
                                       sliding_window_non_causal=nc), context, 3, 11)
            for w, nc in ((64, True), (64, False), (4, True))]
    assert (outs[0] - outs[1]).abs().max() > 1e-3 and (outs[0] - outs[2]).abs().max() > 1e-3


def test_sliding_layers_without_a_window_are_full_attention():
    """speculators runs a sliding layer without a window (use_sliding_window false) as full attention
    (bidirectional block, all context); the config stores it so and the model computes it so."""
    cfg = tiny_draft_config(TARGET.config, layer_types=["sliding_attention"] * 2, sliding_window=None)
    assert cfg.layer_types == ["full_attention"] * 2 and not any(cfg.layer_is_causal(i) for i in range(2))
    full = make_draft(layer_types=["full_attention"] * 2)
    sliding = make_draft(layer_types=["sliding_attention"] * 2, sliding_window=None)
    context = context_states(full, 11)
    torch.testing.assert_close(sliding.forward_block(sliding.new_cache(), context, 3, 11),
                               full.forward_block(full.new_cache(), context, 3, 11), atol=0, rtol=0)


@pytest.mark.parametrize("layer_types,window,non_causal", ATTENTION_CASES[:3])
def test_incremental_rounds_equal_one_shot(layer_types, window, non_causal):
    model = make_draft(layer_types=layer_types, sliding_window=window, sliding_window_non_causal=non_causal)
    context = context_states(model, 20)
    cache, p = model.new_cache(), 0
    for step, new in enumerate([6, 1, 4, 0, 3, 2]):  # 0: re-draft at the same anchor
        hidden = model.forward_block(cache, context[p:p + new], 10 + step, p + new)
        p += new
        assert cache.length == p
        one_shot = model.forward_block(model.new_cache(), context[:p], 10 + step, p)
        torch.testing.assert_close(hidden, one_shot, atol=1e-5, rtol=1e-5)


def test_crop_rolls_back_the_context():
    model = make_draft()
    context = context_states(model, 12)
    cache = model.new_cache()
    model.forward_block(cache, context[:12], 4, 12)
    cache.crop(7)
    assert cache.length == 7
    hidden = model.forward_block(cache, context[7:9], 5, 9)
    torch.testing.assert_close(hidden, model.forward_block(model.new_cache(), context[:9], 5, 9))
    with pytest.raises(ValueError, match=r"DraftCache.crop: n must be in \[0, 9\], got 10"):
        cache.crop(10)


def test_cache_grows_past_its_initial_capacity():
    model = make_draft(layer_types=["full_attention"])
    context = context_states(model, 70)
    cache = model.new_cache()
    for start in range(0, 70, 10):
        hidden = model.forward_block(cache, context[start:start + 10], 1, start + 10)
    torch.testing.assert_close(hidden, model.forward_block(model.new_cache(), context, 1, 70))


def test_anchor_token_as_tensor_and_half_precision():
    model = make_draft()
    context = context_states(model, 6)
    ref = model.forward_block(model.new_cache(), context, 9, 6)
    torch.testing.assert_close(model.forward_block(model.new_cache(), context, torch.tensor([9]), 6), ref)
    half = make_draft().to(torch.bfloat16)
    out = half.forward_block(half.new_cache(), context.bfloat16(), torch.tensor(9, dtype=torch.int32), 6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.15, rtol=0.05)


def test_forward_block_argument_errors():
    model = make_draft()
    cache = model.new_cache()
    good = context_states(model, 5)
    with pytest.raises(ValueError, match=r"forward_block: context_hidden must have shape \[5, 96\], got \[4, 96\]"):
        model.forward_block(cache, good[:4], 1, 5)
    with pytest.raises(TypeError, match="forward_block: context_hidden must have dtype"):
        model.forward_block(cache, good.long(), 1, 5)
    with pytest.raises(ValueError, match=r"forward_block: anchor_token must be in \[0, 95\], got 96"):
        model.forward_block(cache, good, V, 5)
    with pytest.raises(ValueError, match="forward_block: anchor_token holds token id -1"):
        model.forward_block(cache, good, torch.tensor([-1]), 5)
    with pytest.raises(TypeError, match="forward_block: cache must be a DraftCache"):
        model.forward_block(make_draft(layer_types=["full_attention"]).new_cache(), good, 1, 5)
    model.forward_block(cache, good, 1, 5)
    with pytest.raises(ValueError, match=r"forward_block: anchor_position must be in \[5, inf\], got 3"):
        model.forward_block(cache, good[:0], 1, 3)


# ---- heads (runtime.md §3, §4) -------------------------------------------------------------------


def test_vanilla_markov_bias_is_w2_w1_prev():
    model = make_draft()
    hidden, prev = torch.randn(3, H), torch.tensor([0, 17, 95])
    bias, state = model.markov_bias(hidden, prev, None)
    assert bias.dtype == torch.float32 and bias.shape == (3, V) and state is None
    w1, w2 = model.markov_w1.double(), model.markov_w2_target.double()
    for b in range(3):
        torch.testing.assert_close(bias[b].double(), w2 @ w1[prev[b]], atol=1e-5, rtol=1e-5)


def test_gated_markov_bias_matches_formula():
    model = make_draft(markov_head_type="gated")
    hidden, prev = torch.randn(2, H), torch.tensor([5, 60])
    bias, _ = model.markov_bias(hidden, prev, None)
    head = {k: v.double() for k, v in model.markov_head.state_dict().items()}
    for b in range(2):
        e = head["markov_w1.weight"][prev[b]]
        g = torch.sigmoid(head["gate_proj.weight"] @ torch.cat([hidden[b].double(), e]) + head["gate_proj.bias"])
        torch.testing.assert_close(bias[b].double(), head["markov_w2.weight"] @ (g * e), atol=1e-5, rtol=1e-5)


def test_rnn_markov_bias_matches_formula_over_steps():
    model = make_draft(markov_head_type="rnn")
    r = model.config.markov_rank
    head = {k: v.double() for k, v in model.markov_head.state_dict().items()}
    hidden, prevs = torch.randn(4, 1, H), [3, 40, 41, 7]
    state, s_ref = None, torch.zeros(r, dtype=torch.float64)
    for k in range(4):
        bias, state = model.markov_bias(hidden[k], torch.tensor([prevs[k]]), state)
        e = head["markov_w1.weight"][prevs[k]]
        z = head["joint_proj.weight"] @ torch.cat([s_ref, e, hidden[k, 0].double()]) + head["joint_proj.bias"]
        g, c, o = z[:r], z[r:2 * r], z[2 * r:]
        s_ref = torch.sigmoid(g) * s_ref + (1 - torch.sigmoid(g)) * torch.tanh(c)
        torch.testing.assert_close(state[0].double(), s_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bias[0].double(), head["markov_w2.weight"] @ torch.tanh(o), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_markov", [True, False])
def test_confidence_logits_and_kernel_layout(with_markov):
    model = make_draft(confidence_head_with_markov=with_markov)
    hidden, prev = torch.randn(2, 3, H), torch.tensor([[4, 8, 15], [16, 23, 42]])
    logits = model.confidence_logits(hidden, prev)
    w, bias = model.confidence_weight.double(), model.confidence_bias.double()
    assert w.shape == (H + (model.config.markov_rank if with_markov else 0),) and bias.shape == (1,)
    for b in range(2):
        for k in range(3):
            x = hidden[b, k].double()
            if with_markov:  # hidden part first, then W1[prev]
                x = torch.cat([x, model.markov_w1[prev[b, k]].double()])
            torch.testing.assert_close(logits[b, k].double(), w @ x + bias[0], atol=1e-5, rtol=1e-5)


def test_no_confidence_head_is_an_error():
    model = make_draft(confidence=False)
    assert model.confidence_head is None
    with pytest.raises(ValueError, match="DSparkDraftModel: this draft has no confidence head"):
        model.confidence_weight
    with pytest.raises(ValueError, match="no confidence head"):
        model.confidence_logits(torch.randn(1, 2, H), torch.zeros(1, 2, dtype=torch.long))


def test_head_argument_errors():
    model = make_draft(markov_head_type="rnn")
    with pytest.raises(ValueError, match="markov_bias: prev_tokens holds token id 96, outside"):
        model.markov_bias(torch.randn(2, H), torch.tensor([1, V]), None)
    with pytest.raises(ValueError, match=r"markov_bias: prev_tokens must have shape \[2\], got \[3\]"):
        model.markov_bias(torch.randn(2, H), torch.tensor([1, 2, 3]), None)
    with pytest.raises(ValueError, match=r"markov_bias: state must have shape \[2, 8\]"):
        model.markov_bias(torch.randn(2, H), torch.tensor([1, 2]), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="confidence_logits: prev_tokens must have dtype"):
        model.confidence_logits(torch.randn(1, 2, H), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"backbone_logits: hidden must have shape \[\.\.\., 32\]"):
        model.backbone_logits(torch.randn(2, 7))


# ---- reduced vocabulary (runtime.md §2.8) --------------------------------------------------------


def test_reduced_vocab_maps_into_target_ids():
    model = make_draft(draft_vocab_size=30)
    kept = model.t2d.nonzero().flatten()
    assert kept.numel() == 30
    torch.testing.assert_close(torch.arange(30) + model.d2t, kept)  # target_id = draft_id + d2t[draft_id]
    hidden = torch.randn(4, H)
    logits = model.backbone_logits(hidden)
    assert logits.shape == (4, V)
    assert torch.isinf(logits[:, ~model.t2d]).all() and torch.isfinite(logits[:, model.t2d]).all()
    torch.testing.assert_close(logits[:, kept], hidden @ model.lm_head.weight.T)
    w2 = model.markov_w2_target
    assert w2.shape == (V, model.config.markov_rank)
    assert (w2[~model.t2d] == 0).all()
    torch.testing.assert_close(w2[kept], model.markov_head.markov_w2.weight)
    bias, _ = model.markov_bias(hidden[:2], torch.tensor([1, 2]), None)
    torch.testing.assert_close(bias, model.markov_w1[[1, 2]] @ w2.T)
    model.markov_head.markov_w2.weight.mul_(2)  # the cached scatter follows weight updates
    torch.testing.assert_close(model.markov_w2_target[kept], model.markov_head.markov_w2.weight)


def test_full_vocab_shares_w2():
    model = make_draft()
    assert model.markov_w2_target is model.markov_head.markov_w2.weight
    assert not hasattr(model, "d2t")


# ---- config ---------------------------------------------------------------------------------------


def test_config_derived_values():
    cfg = tiny_draft_config(TARGET.config, block_size=7)
    assert cfg.num_draft_tokens == 7 and cfg.draft_vocab_size == V
    assert tiny_draft_config(TARGET.config, block_size=7, sample_from_anchor=False).num_draft_tokens == 6
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, True]
    assert [cfg.layer_window(i) for i in range(2)] == [None, 8]


@pytest.mark.parametrize("override,message", [
    ({"layer_types": ["full_attention"], "num_hidden_layers": 2}, "layer_types must have num_hidden_layers=2 entries, got 1"),
    ({"layer_types": ["full_attention", "chunked"]}, "layer_types entries must be one of"),
    ({"mask_token_id": 96}, r"mask_token_id must be in \[0, 95\], got 96"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ({"draft_vocab_size": 97}, r"draft_vocab_size must be in \[1, 96\], got 97"),
    ({"markov_head_type": "lstm"}, "markov_head_type must be one of"),
    ({"capture_layer_ids": [1, 4]}, r"capture_layer_ids \[1, 4\] must be < num_target_layers \(4\)"),
    ({"capture_layer_ids": []}, "capture_layer_ids must be a non-empty list"),
    ({"sts_temperatures": [1.0, -0.5]}, "sts_temperatures must be a non-empty list of positive floats"),
    ({"block_size": 1, "sample_from_anchor": False}, "block_size must be >= 2 when sample_from_anchor is False"),
])
def test_config_errors(override, message):
    with pytest.raises(ValueError, match="DSparkConfig: " + message):
        tiny_draft_config(TARGET.config, **override)


def test_config_type_errors():
    with pytest.raises(TypeError, match="DSparkConfig: block_size must be an int, got float"):
        tiny_draft_config(TARGET.config, block_size=4.0)
    assert isinstance(DSparkConfig.from_dict(tiny_draft_config(TARGET.config).to_speculators_dict()), DSparkConfig)


# ---- the tensors the engine hands to dspark.kernels ----------------------------------------------


@pytest.mark.parametrize("draft_vocab_size", [None, 40])
def test_model_tensors_fit_the_kernels(draft_vocab_size):
    """``backbone_logits`` / ``markov_w1`` / ``markov_w2_target`` / ``confidence_*`` in a half-precision
    model are what ``dspark.kernels`` takes: its results equal the model's own head math."""
    import dspark.kernels as K

    model = make_draft(draft_vocab_size=draft_vocab_size, block_size=3).to(torch.float16)
    hidden = model.forward_block(model.new_cache(), context_states(model, 5).half(), 2, 5)
    logits = model.backbone_logits(hidden)
    drafts = torch.tensor([[11, 4, 0]], dtype=torch.int32)  # step k's previous token: anchor, then drafts
    prev = torch.tensor([2, 11, 4])
    for step in range(3):
        got = K.build_markov_logits(logits[None], model.markov_w1, model.markov_w2_target,
                                    torch.tensor([2], dtype=torch.int32), drafts, step)
        bias, _ = model.markov_bias(hidden[step:step + 1], prev[step:step + 1], None)
        torch.testing.assert_close(got, logits[step:step + 1] + bias, atol=1e-3, rtol=1e-3)
    scores = K.compute_confidence_scores(hidden[None], model.markov_w1, model.confidence_weight, model.confidence_bias,
                                         torch.tensor([2], dtype=torch.int32), drafts, confidence_with_markov=True)
    torch.testing.assert_close(scores, torch.sigmoid(model.confidence_logits(hidden[None], prev[None])),
                               atol=1e-4, rtol=1e-4)


@gpu
def test_cuda_bfloat16_matches_cpu():
    cpu = make_draft(draft_vocab_size=50, markov_head_type="rnn")
    cuda = make_draft(draft_vocab_size=50, markov_head_type="rnn").to("cuda", torch.bfloat16)
    context = context_states(cpu, 12)
    cache_cpu, cache_cuda = cpu.new_cache(), cuda.new_cache()
    for start, end in ((0, 9), (9, 12)):
        ref = cpu.forward_block(cache_cpu, context[start:end], 3, end)
        out = cuda.forward_block(cache_cuda, context[start:end].to("cuda", torch.bfloat16),
                                 torch.tensor([3], device="cuda"), end)
        torch.testing.assert_close(out.float().cpu(), ref, atol=0.15, rtol=0.05)
    logits = cuda.backbone_logits(out)
    assert torch.equal(torch.isinf(logits).cpu(), torch.isinf(cpu.backbone_logits(ref)))
    bias, state = cuda.markov_bias(out[:2], torch.tensor([1, 2], device="cuda"), None)
    assert bias.device.type == "cuda" and state.dtype == torch.float32
