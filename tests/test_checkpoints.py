"""Checkpoint formats (runtime.md §6), the heads sidecar (Part II §5.1), layer-id conventions
(§2.1) and every loading / compatibility error."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import gpu
from model_cases import random_draft, tiny_draft_config, tiny_qwen3_target, write_tiny_draft
from safetensors.torch import load_file, save_file

from dspark.model import (
    DSparkConfig,
    check_target_compatible,
    load_draft,
    load_heads_sidecar,
    save_draft,
    save_heads_sidecar,
)

TARGET = tiny_qwen3_target()
L_T = TARGET.config.num_hidden_layers


def rewrite(directory, *, config=None, tensors=None):
    """Edit a saved checkpoint in place: ``config(dict)`` / ``tensors(dict)`` mutate them."""
    if config is not None:
        d = json.loads((directory / "config.json").read_text())
        config(d)
        (directory / "config.json").write_text(json.dumps(d))
    if tensors is not None:
        t = load_file(str(directory / "model.safetensors"))
        tensors(t)
        save_file(t, str(directory / "model.safetensors"))


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def run_round(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(9, model.config.num_capture_layers * model.config.hidden_size, generator=g)
    hidden = model.forward_block(model.new_cache(), context.to(model.device, model.dtype), 5, 9)
    return hidden, model.backbone_logits(hidden)


# ---- layer-id conventions (runtime.md §2.1) -----------------------------------------------------


def test_hf_hidden_states_index_conventions():
    """speculators id a = input of decoder layer a = hidden_states[a];
    DeepSpec id j = output of decoder layer j = hidden_states[j+1]; the last entry is post-norm."""
    inputs, outputs = {}, {}
    hooks = []
    for i, layer in enumerate(TARGET.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(
            lambda m, args, out, i=i: outputs.__setitem__(i, (out[0] if isinstance(out, tuple) else out).clone())))
    try:
        with torch.no_grad():
            states = TARGET(torch.arange(7)[None], output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    assert len(states) == L_T + 1
    for a in range(L_T):
        torch.testing.assert_close(states[a], inputs[a])
    for j in range(L_T - 1):
        torch.testing.assert_close(states[j + 1], outputs[j])
    assert not torch.allclose(states[L_T], outputs[L_T - 1])  # post-final-norm: never a draft input


def test_capture_ids_in_both_formats(tmp_path):
    model = random_draft(tiny_draft_config(TARGET.config, capture_layer_ids=[0, 2, 3]), 0, TARGET)
    spec = save_draft(model, tmp_path / "spec", format="speculators")
    deep = save_draft(model, tmp_path / "deep", format="deepspec")
    spec_cfg = json.loads((spec / "config.json").read_text())
    deep_cfg = json.loads((deep / "config.json").read_text())
    assert spec_cfg["aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert deep_cfg["target_layer_ids"] == [-1, 1, 2]  # -1 = embedding output
    assert load_draft(spec).config.capture_layer_ids == load_draft(deep).config.capture_layer_ids == [0, 2, 3]


def test_published_config_examples_parse():
    """The two example configs of runtime.md §6.1/§6.2, trimmed to the keys that matter."""
    kimi = {
        "architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark",
        "aux_hidden_state_layer_ids": [24, 48, 72, 88, 92], "block_size": 8, "sample_from_anchor": True,
        "draft_vocab_size": 163840, "mask_token_id": 163837, "markov_rank": 256, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True, "sliding_window_non_causal": False,
        "dtype": "bfloat16",
        "transformer_layer_config": {
            "model_type": "qwen3", "hidden_size": 7168, "intermediate_size": 14336, "num_hidden_layers": 5,
            "num_attention_heads": 96, "num_key_value_heads": 16, "head_dim": 64, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "vocab_size": 163840, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "use_sliding_window": True,
            "attention_bias": False}}
    cfg = DSparkConfig.from_dict(kimi)
    assert cfg.checkpoint_format == "speculators" and cfg.capture_layer_ids == [24, 48, 72, 88, 92]
    assert cfg.num_draft_tokens == 8 and not cfg.reduced_vocab
    assert all(cfg.layer_is_causal(i) and cfg.layer_window(i) == 2048 for i in range(5))
    del kimi["transformer_layer_config"]["sliding_window"]  # Qwen3Config's default applies
    assert DSparkConfig.from_dict(kimi).sliding_window == 4096
    qwen3_8b = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 151936, "num_target_layers": 36,
        "block_size": 7, "layer_types": ["full_attention"] * 5, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": False, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
        "enable_confidence_head": True, "confidence_head_with_markov": True, "markov_rank": 256,
        "markov_head_type": "vanilla", "torch_dtype": "bfloat16"}
    cfg = DSparkConfig.from_dict(qwen3_8b)
    assert cfg.checkpoint_format == "deepspec" and cfg.capture_layer_ids == [2, 10, 18, 26, 34]
    assert cfg.sample_from_anchor and cfg.num_draft_tokens == 7 and cfg.rope_theta == 1e6
    assert not any(cfg.layer_is_causal(i) or cfg.layer_window(i) for i in range(5))
    legacy = dict(qwen3_8b)
    legacy["dflash_config"] = {"mask_token_id": legacy.pop("mask_token_id"), "target_layer_ids": legacy.pop("target_layer_ids")}
    assert DSparkConfig.from_dict(legacy).capture_layer_ids == [2, 10, 18, 26, 34]


# ---- round trips ----------------------------------------------------------------------------------


def test_both_formats_load_to_identical_models(tmp_path):
    model = random_draft(tiny_draft_config(TARGET.config), 3, TARGET)
    spec = load_draft(save_draft(model, tmp_path / "spec", format="speculators"))
    deep = load_draft(save_draft(model, tmp_path / "deep", format="deepspec"))
    assert spec.config.checkpoint_format == "speculators" and deep.config.checkpoint_format == "deepspec"
    assert_same_model(model, spec)
    assert_same_model(spec, deep)
    for a, b in zip(run_round(spec), run_round(deep)):
        assert torch.equal(a, b)
    torch.testing.assert_close(run_round(spec)[1], run_round(model)[1])


CASES = [
    dict(markov_head_type="vanilla"),
    dict(markov_head_type="gated", confidence=False),
    dict(markov_head_type="rnn", draft_vocab_size=40, sample_from_anchor=False, block_size=5),
    dict(layer_types=["sliding_attention"] * 3, sliding_window_non_causal=True, sts_temperatures=[1.0, 0.8, 1.3]),
    dict(markov_rank=0),  # no Markov head (DFlash-style); the confidence head reads h alone
]


@pytest.mark.parametrize("fmt,case", [(f, c) for f in ("speculators", "deepspec") for c in CASES
                                      if f == "speculators" or "draft_vocab_size" not in c])  # DeepSpec: full vocab
def test_round_trip(tmp_path, fmt, case):
    case = dict(case)
    confidence = case.pop("confidence", True)
    config = tiny_draft_config(TARGET.config, confidence=confidence, checkpoint_format=fmt, **case)
    model = random_draft(config, 1, TARGET)
    loaded = load_draft(save_draft(model, tmp_path, format=fmt))
    assert_same_model(model, loaded)
    expected = config.to_dict()
    got = loaded.config.to_dict()
    if fmt == "speculators":  # the speculators config does not record the target's layer count
        expected["num_target_layers"] = None
    assert got == expected
    for a, b in zip(run_round(model), run_round(loaded)):
        assert torch.equal(a, b)


def test_dtype_and_device_arguments(tmp_path):
    path = write_tiny_draft(TARGET, tmp_path, format="speculators", draft_vocab_size=50)
    model = load_draft(path, dtype=torch.float16, device="cpu")
    assert model.dtype == torch.float16 and model.config.dtype == "float16"
    assert model.d2t.dtype == torch.int64 and model.t2d.dtype == torch.bool
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    half = load_draft(save_draft(model, tmp_path / "half"))
    assert half.dtype == torch.float16 and json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == "float16"
    with pytest.raises(TypeError, match="load_draft: dtype must be"):
        load_draft(path, dtype=torch.int8)


@gpu
def test_load_to_cuda(tmp_path):
    path = write_tiny_draft(TARGET, tmp_path, format="speculators", draft_vocab_size=50)
    model = load_draft(path, device="cuda", dtype=torch.bfloat16)
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert model.markov_w2_target.device.type == "cuda" and model.markov_w2_target.dtype == torch.bfloat16
    hidden, logits = run_round(model)
    reference = run_round(load_draft(path))[1]
    assert torch.equal(torch.isinf(logits).cpu(), torch.isinf(reference))
    torch.testing.assert_close(logits.cpu(), reference, atol=0.1, rtol=0.05)


def test_sharded_checkpoint(tmp_path):
    path = write_tiny_draft(TARGET, tmp_path, format="deepspec")
    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / file))
    (path / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_model(load_draft(path), load_draft(write_tiny_draft(TARGET, tmp_path / "one", format="deepspec")))


# ---- heads sidecar (TensorRT-Edge-LLM dspark_heads.safetensors) -----------------------------------


@pytest.mark.parametrize("with_markov", [True, False])
def test_heads_sidecar_round_trip(tmp_path, with_markov):
    model = random_draft(tiny_draft_config(TARGET.config, confidence_head_with_markov=with_markov), 0, TARGET)
    file = save_heads_sidecar(model, tmp_path)
    assert file.name == "dspark_heads.safetensors"
    heads = load_heads_sidecar(tmp_path)
    v, r, h = TARGET.config.vocab_size, model.config.markov_rank, model.config.hidden_size
    expect = {"markov_w1": [v, r], "markov_w2": [v, r], "confidence_weight": [h + (r if with_markov else 0)],
              "confidence_bias": [1]}
    assert {k: list(t.shape) for k, t in heads.items()} == expect
    assert all(t.dtype == torch.float16 for t in heads.values())
    assert torch.equal(heads["markov_w1"], model.markov_head.markov_w1.weight.half())
    assert torch.equal(heads["markov_w2"], model.markov_head.markov_w2.weight.half())
    assert torch.equal(heads["confidence_weight"], model.confidence_head.proj.weight[0].half())
    assert torch.equal(heads["confidence_bias"], model.confidence_head.proj.bias.half())


def test_heads_sidecar_without_confidence_and_refusals(tmp_path):
    plain = random_draft(tiny_draft_config(TARGET.config, enable_confidence_head=False), 0, TARGET)
    assert set(load_heads_sidecar(save_heads_sidecar(plain, tmp_path / "x.safetensors"))) == {"markov_w1", "markov_w2"}
    with pytest.raises(ValueError, match="save_heads_sidecar: the heads sidecar needs a full-vocabulary draft"):
        save_heads_sidecar(random_draft(tiny_draft_config(TARGET.config, draft_vocab_size=50)), tmp_path)
    with pytest.raises(ValueError, match="save_heads_sidecar: the heads sidecar holds a vanilla Markov head only"):
        save_heads_sidecar(random_draft(tiny_draft_config(TARGET.config, markov_head_type="gated")), tmp_path)
    with pytest.raises(ValueError, match=r"save_heads_sidecar: the heads sidecar holds a Markov head, but this draft has none"):
        save_heads_sidecar(random_draft(tiny_draft_config(TARGET.config, markov_rank=0)), tmp_path)


@pytest.mark.parametrize("edit,error,message", [
    (lambda t: t.pop("markov_w2"), ValueError, "missing tensor 'markov_w2'"),
    (lambda t: t.update(extra=torch.zeros(1, dtype=torch.float16)), ValueError, "unexpected tensor 'extra'"),
    (lambda t: t.update(markov_w1=t["markov_w1"].float()), TypeError, "markov_w1 must have dtype torch.float16"),
    (lambda t: t.update(markov_w2=t["markov_w2"][:-1].contiguous()), ValueError, r"markov_w2 must have shape \[96, 8\]"),
    (lambda t: t.pop("confidence_bias"), ValueError, "confidence_weight and confidence_bias must be given together"),
    (lambda t: t.update(confidence_bias=torch.zeros(2, dtype=torch.float16)), ValueError, r"confidence_bias must have shape \[1\]"),
])
def test_heads_sidecar_load_errors(tmp_path, edit, error, message):
    file = save_heads_sidecar(random_draft(tiny_draft_config(TARGET.config)), tmp_path)
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))
    with pytest.raises(error, match="load_heads_sidecar: " + message):
        load_heads_sidecar(file)


# ---- loading errors -------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    return write_tiny_draft(TARGET, tmp_path / "draft", format="speculators", draft_vocab_size=60)


def test_missing_tensor(saved):
    rewrite(saved, tensors=lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"load_draft: checkpoint is missing tensor 'layers.1.self_attn.k_norm.weight' \(expected shape \[8\]\)"):
        load_draft(saved)


def test_extra_tensor(saved):
    rewrite(saved, tensors=lambda t: t.update({"verifier_lm_head.weight": torch.zeros(3, 32)}))
    with pytest.raises(ValueError, match=r"load_draft: checkpoint has unexpected tensor 'verifier_lm_head.weight' \(shape \[3, 32\]\)"):
        load_draft(saved)


def test_config_and_tensors_disagree_on_heads(saved):
    rewrite(saved, config=lambda d: d.update(markov_head_type="gated"))
    with pytest.raises(ValueError, match="load_draft: checkpoint is missing tensor 'markov_head.gate_proj.bias'"):
        load_draft(saved)


def test_misshaped_tensor(saved):
    rewrite(saved, tensors=lambda t: t.update({"fc.weight": torch.zeros(32, 128)}))
    with pytest.raises(ValueError, match=r"load_draft: tensor 'fc.weight' has shape \[32, 128\] in the checkpoint, expected \[32, 96\]"):
        load_draft(saved)


def test_wrong_tensor_dtype(saved):
    rewrite(saved, tensors=lambda t: t.update({"norm.weight": torch.ones(32, dtype=torch.int32)}))
    with pytest.raises(TypeError, match="load_draft: tensor 'norm.weight' has dtype torch.int32"):
        load_draft(saved)


def _drop_first_kept(t):
    t["t2d"][t["t2d"].nonzero()[0]] = False


def _past_the_vocab(t):
    t["d2t"][-1] += 1000


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update(d2t=t["d2t"].flip(0).contiguous()), "d2t must map draft ids to strictly increasing target ids"),
    (_drop_first_kept, "t2d marks 59 target ids but d2t maps to 60"),
    (_past_the_vocab, r"d2t maps draft ids to target ids in \[\d+, \d+\], outside \[0, 96\)"),
])
def test_inconsistent_vocab_mapping(saved, edit, message):
    rewrite(saved, tensors=edit)
    with pytest.raises(ValueError, match="load_draft: " + message):
        load_draft(saved)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("speculators_model_type"), "unknown checkpoint format: config.json has neither"),
    (lambda d: d.update(speculators_model_type="eagle3"), "unknown checkpoint format: speculators_model_type is 'eagle3'"),
    (lambda d: (d.pop("speculators_model_type"), d.update(architectures=["Gemma4DSparkModel"])), "unsupported DeepSpec architecture"),
    (lambda d: d.pop("mask_token_id"), "config.json is missing the key 'mask_token_id'"),
    (lambda d: d["transformer_layer_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     "only the default RoPE is supported, got rope_type 'yarn'"),
])
def test_bad_config(saved, edit, message):
    rewrite(saved, config=edit)
    with pytest.raises(ValueError, match=message):
        load_draft(saved)


def _sliding_without_window(d):
    layer = d.get("transformer_layer_config", d)
    layer.update(layer_types=["sliding_attention"] * 2, use_sliding_window=False, sliding_window=None)


def test_sliding_layers_without_a_window(tmp_path):
    """speculators runs sliding layers without a window as full attention, so dspark reads them so;
    what DeepSpec does is not pinned down, so its format refuses them, naming the keys."""
    model = random_draft(tiny_draft_config(TARGET.config, layer_types=["full_attention"] * 2), 0, TARGET)
    spec = save_draft(model, tmp_path / "spec", format="speculators")
    rewrite(spec, config=_sliding_without_window)
    loaded = load_draft(spec)
    assert loaded.config.layer_types == ["full_attention"] * 2 and loaded.config.sliding_window is None
    for a, b in zip(run_round(model), run_round(loaded)):
        assert torch.equal(a, b)
    deep = save_draft(model, tmp_path / "deep", format="deepspec")
    rewrite(deep, config=_sliding_without_window)
    with pytest.raises(ValueError, match=r"DSparkConfig.from_dict: layer_types holds 'sliding_attention' but there is "
                                         r"no window \(use_sliding_window=False, sliding_window=None\)"):
        load_draft(deep)


def test_missing_files_and_pickles(tmp_path, saved):
    with pytest.raises(ValueError, match="load_draft: path must be a checkpoint directory"):
        load_draft(tmp_path / "nowhere")
    (saved / "model.safetensors").rename(saved / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"load_draft: no model.safetensors .* safetensors only; refusing to unpickle \['pytorch_model.bin'\]"):
        load_draft(saved)
    (saved / "config.json").unlink()
    with pytest.raises(ValueError, match="load_draft: no config.json in"):
        load_draft(saved)


def test_deepspec_refuses_reduced_vocab(tmp_path):
    model = random_draft(tiny_draft_config(TARGET.config, draft_vocab_size=50))
    with pytest.raises(ValueError, match="the DeepSpec format has no reduced vocabulary"):
        save_draft(model, tmp_path, format="deepspec")
    with pytest.raises(ValueError, match="save_draft: format must be one of"):
        save_draft(model, tmp_path, format="gguf")


# ---- draft / target compatibility -----------------------------------------------------------------


def test_compatible_target_passes():
    cfg = tiny_draft_config(TARGET.config)
    check_target_compatible(cfg, TARGET.config)
    check_target_compatible(cfg, TARGET.config.to_dict())


@pytest.mark.parametrize("target_kwargs,draft_kwargs,message", [
    ({"hidden_size": 64, "head_dim": 16}, {}, "hidden size mismatch: draft hidden_size=32, target hidden_size=64"),
    ({"vocab_size": 100}, {}, "vocabulary mismatch: draft vocab_size=96, target vocab_size=100"),
    ({"num_hidden_layers": 3}, {"num_target_layers": None}, r"capture layer id\(s\) \[3\] out of range for a 3-layer target"),
    ({"num_hidden_layers": 5}, {}, "layer count mismatch: draft num_target_layers=4, target num_hidden_layers=5"),
])
def test_incompatible_target(target_kwargs, draft_kwargs, message):
    target_config = tiny_qwen3_target(**target_kwargs).config
    with pytest.raises(ValueError, match="check_target_compatible: " + message):
        check_target_compatible(tiny_draft_config(TARGET.config, **draft_kwargs), target_config)
