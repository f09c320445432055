"""Targets of other transformers families through ``LLMEngine`` (``HFTarget``: their own modeling
code on the engine's ragged tokens and KV cache).

Oracle: transformers' own greedy ``generate()``. Tiny random models (float32) of five families
beyond Llama / Qwen -- Mistral, Phi-3, a Qwen3 mixture of experts, GPT-NeoX (partial rotary, MHA,
parallel residual), OLMo-2 (norms after attention and MLP), and sliding-window Mistral and Gemma 3
(windows of 4-5 tokens, Gemma's local/global layers) -- decode with a random DSpark drafter
built for them and with plain decoding: greedy output identical to ``generate()``, each request the
same alone and in a batch, prompts chunked into running steps; a sampled request is the same alone
and in a batch. Attention soft-capping is refused with an error naming it.

The hybrid families whose stateful layers the engine keeps (gated DeltaNet: Qwen3-Next with
experts, Qwen3.5, Qwen3.5-MoE, LaraMini, OLMo-Hybrid; Mamba-2: Bamba, Granite-4, Falcon-H1,
Nemotron-H with MLP-only layers, Mamba2; Mamba-1: Jamba with experts, Mamba, FalconMamba; short
convolutions: LFM2, LFM2-MoE, LFM3) are among the families above; Mamba, FalconMamba and Mamba2 have
no attention layer at all.
Every family, a tiny random checkpoint decoded by ``dspark.generate``, has one outcome written down:
transformers' greedy tokens (the fused Llama / Qwen path and the families above) or a refusal naming
the layers whose state the engine does not keep (Zamba2, RWKV, RecurrentGemma here;
``test_hybrid_families`` lists every stateful family of transformers).
``draft_config`` builds a drafter for targets that spell the norm epsilon and head counts otherwise.

CUDA graphs: the families whose transformers code synchronises the host are declared from the
config; the others' forwards read no device value on the host (checked on the CPU op by op); a
forward that fails inside a capture makes the target eager, any other failed capture that graph,
with the same tokens (a simulated capture on the CPU, a forward calling ``.item()`` on CUDA); on
CUDA every family with graphs on equals ``generate()``.
"""

import re
from types import SimpleNamespace

import pytest
import torch
from model_cases import random_draft, tiny_draft_config

from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.model.hf_target import HFTarget

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, NEW = 96, 12
PROMPTS = [[3, 17, 42, 8, 61, 5], [9, 1], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18], [60]]
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)


KV = dict(num_key_value_heads=2)
_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4)  # gated DeltaNet layers
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
               mamba_d_conv=4)
# name: (transformers model class, its config class, the config's own settings beyond the size)
SPECS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", KV),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", KV),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(**KV, head_dim=16)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(**KV, head_dim=8, sliding_window=None)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", KV),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        **KV, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(rotary_pct=0.5, use_parallel_residual=True)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", KV),
    # sliding layers with windows far below the outputs' length: every verify row and prompt
    # chunk spans window edges
    "mistral-sliding": ("MistralForCausalLM", "MistralConfig", dict(**KV, head_dim=8, sliding_window=5)),
    "gemma3-sliding": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        **KV, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    # hybrid and recurrent families: layers whose state is not a KV cache
    "qwen3-next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        **KV, head_dim=16, **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "qwen3.5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(**KV, head_dim=16, **_LINEAR)),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(
        **KV, num_hidden_layers=3, full_attn_idxs=[1], conv_L_cache=3, block_auto_adjust_ff_dim=False)),
    "falcon-h1": ("FalconH1ForCausalLM", "FalconH1Config", dict(  # MuP multipliers of its own
        **KV, num_hidden_layers=3, head_dim=16, mamba_d_ssm=128, **_MAMBA2, ssm_in_multiplier=0.7,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9])),
    # Mamba-1 beside attention, experts in every layer
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(
        **KV, num_hidden_layers=3, attn_layer_period=2, attn_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        expert_layer_period=1, expert_layer_offset=0, mamba_d_state=8, mamba_dt_rank=8)),
    "nemotron-h": ("NemotronHForCausalLM", "NemotronHConfig", dict(
        **KV, layers_block_type=["linear_attention", "full_attention", "mlp"], num_hidden_layers=3, head_dim=16,
        mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=8, n_groups=1, chunk_size=16, conv_kernel=4)),
    "bamba": ("BambaForCausalLM", "BambaConfig", dict(
        **KV, num_hidden_layers=3, attn_layer_indices=[1], **{**_MAMBA2, "mamba_d_head": "auto"})),
    "zamba2": ("Zamba2ForCausalLM", "Zamba2Config", dict(
        **KV, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_headdim=32, mamba_d_state=8,
        n_mamba_heads=4, mamba_ngroups=1, chunk_size=16)),
    "granite-moe-hybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", dict(
        **KV, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=0,
        shared_intermediate_size=128, **{**_MAMBA2, "mamba_d_head": "auto"})),
    # attention-free: no K/V at all
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(num_hidden_layers=3, state_size=8)),
    "falcon-mamba": ("FalconMambaForCausalLM", "FalconMambaConfig", dict(num_hidden_layers=3, state_size=8)),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config", dict(
        hidden_size=32, num_hidden_layers=3, num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=16)),
    # the mixers above in other families' layers
    "lfm2-moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig", dict(
        **KV, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32)),
    "lfm3": ("Lfm3ForCausalLM", "Lfm3Config", dict(
        **KV, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], head_dim=8, sliding_window=None)),
    "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(
        **KV, head_dim=16, **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "olmo-hybrid": ("OlmoHybridForCausalLM", "OlmoHybridConfig", dict(  # beta in [0, 2], projections of its own
        **KV, **_LINEAR, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])),
    "lara-mini": ("LaraMiniForCausalLM", "LaraMiniConfig", dict(  # sliding-window layers too
        **KV, head_dim=16, **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "rwkv": ("RwkvForCausalLM", "RwkvConfig", dict(num_hidden_layers=2, attention_hidden_size=64, context_length=64)),
    "recurrent-gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", dict(
        num_hidden_layers=2, lru_width=64, head_dim=16, block_types=["recurrent", "attention"],
        attention_window_size=16)),
}
# hybrid families whose stateful layers the engine runs exactly (``dspark.model.hybrid``, ``.mamba``):
# each mixer kind through every rollback case (``test_hybrid_target``) ...
HYBRID = ["qwen3.5", "qwen3-next", "lfm2", "bamba", "granite-moe-hybrid", "falcon-h1", "jamba", "mamba"]
# ... and the same mixers in other families (Mamba-2 of Nemotron-H with its MLP-only layers, pure Mamba-2)
HYBRID_ALIKE = ["falcon-mamba", "mamba2", "nemotron-h", "lfm2-moe", "lfm3", "qwen3.5-moe", "lara-mini", "olmo-hybrid"]
DELTANET = {"qwen3.5", "qwen3-next", "qwen3.5-moe", "lara-mini", "olmo-hybrid"}  # fla's kernel on a GPU
FAMILIES = ["mistral", "phi3", "qwen3-moe", "gpt-neox", "olmo2", "mistral-sliding", "gemma3-sliding", *HYBRID,
            *HYBRID_ALIKE]
# experts that loop on the host by default (Nemotron-H's config declares them without MoE layers here)
MOE = {"qwen3-moe", "qwen3-next", "jamba", "lfm2-moe", "qwen3.5-moe", "lara-mini", "nemotron-h"}


def _model(name, size=COMMON):
    """A random ``name`` model of ``size`` (float32, eval mode); skipped only when the installed
    transformers has no such class."""
    import transformers as t

    model_class, config_class, settings = SPECS[name]
    if not hasattr(t, model_class):
        pytest.skip(f"transformers {t.__version__} has no {model_class}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return getattr(t, model_class)(getattr(t, config_class)(**{**size, **settings})).eval()


def _drafter(model):
    """A random DSpark draft (Qwen3-style layers, its own shape) reading ``model``'s hidden states."""
    c = model.config
    shape = SimpleNamespace(hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=c.vocab_size,
                            rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0})
    return random_draft(tiny_draft_config(shape), 0, model)


def _generate(model, prompt, n):
    """transformers' own greedy decoding: the oracle."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = _model(request.param)
    return request.param, model, [_generate(model, p, NEW) for p in PROMPTS]


def test_greedy_equals_transformers_generate(family):
    name, model, expected = family
    for draft in (_drafter(model), None):
        engine = LLMEngine(model, draft, EngineConfig(max_batch=3, max_num_batched_tokens=3 * 5 + 4))
        assert isinstance(engine.target, HFTarget), name
        batched = engine.generate([Request(p, NEW) for p in PROMPTS])  # 4 requests, 3 rows, chunked prompts
        assert [r.token_ids for r in batched] == expected, name
        alone = engine.generate([Request(PROMPTS[2], NEW)])[0]
        assert alone.token_ids == expected[2]
        if draft is not None:
            assert batched[0].stats.rounds > 0
    assert _generate(model, PROMPTS[0], 4) == expected[0][:4]  # the model keeps its own attention outside the engine


def test_a_checkpoint_directory_of_another_family(tmp_path):
    from dspark.model import save_draft

    model = _model("mistral")
    model.save_pretrained(tmp_path / "target")
    draft = save_draft(_drafter(model), tmp_path / "draft", format="speculators")
    engine = LLMEngine(str(tmp_path / "target"), str(draft), EngineConfig(max_batch=2))
    assert isinstance(engine.target, HFTarget)
    assert engine.generate([Request(PROMPTS[0], NEW)])[0].token_ids == _generate(model, PROMPTS[0], NEW)


@pytest.mark.parametrize("name", [name for name in FAMILIES if name not in HYBRID_ALIKE])  # mixers sampled here
def test_sampled_request_is_the_same_alone_and_in_a_batch(name):
    model = _model(name)
    engine = LLMEngine(model, _drafter(model), EngineConfig(max_batch=4))
    hot = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    alone = engine.generate([Request(PROMPTS[2], NEW, hot)])[0].token_ids
    mixed = engine.generate([Request(PROMPTS[1], NEW, SamplingParams(temperature=1.0, seed=3)),
                             Request(PROMPTS[2], NEW, hot), Request(PROMPTS[0], NEW)])
    assert mixed[1].token_ids == alone, name


def test_captured_states_are_the_models_hidden_states():
    from dspark.model.llama import AttentionBatch

    model = _model("phi3")
    target = HFTarget(model, [0, 2, 3])
    ids = torch.tensor(PROMPTS[2])
    cache = target.new_cache(2, 32)
    n = ids.numel()
    batch = AttentionBatch(torch.tensor([1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                           torch.tensor([0, n], dtype=torch.int32), n)
    capture = torch.empty(n, 3 * 32)
    logits = target.forward(ids, torch.arange(n, dtype=torch.int32), torch.ones(n, dtype=torch.int32), batch, cache,
                            capture_out=capture, logits_rows=torch.tensor([n - 1]))
    model.config._attn_implementation = "eager"  # transformers' own attention for the reference
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i][0] for i in (0, 2, 3)], dim=-1)
    torch.testing.assert_close(capture, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref.logits[0, -1:], rtol=1e-4, atol=1e-4)


def test_unsupported_attention_is_refused_by_name():
    import transformers as t

    model = t.Gemma2ForCausalLM(t.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="Gemma2Config: attn_logit_softcapping=50.0 is not supported"):
        LLMEngine(model, None, EngineConfig(max_batch=2))


TINY = {**COMMON, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
REFUSAL = "This engine cannot run that layer type exactly yet"
# every family, decoded plainly from its checkpoint directory: "equal" (transformers' greedy
# generate(), token for token) or "refused", the error naming which layers are what (the class
# holding the state, or the declared type alone; declared names vary across transformers releases)
OUTCOMES = {
    **{name: ("equal", ()) for name in ("llama", "qwen2", "qwen3", *FAMILIES)},
    "zamba2": ("refused", (([1], "Zamba2MambaDecoderLayer"),)),  # its shared attention; the Mamba-2 layer runs
    "rwkv": ("refused", (([0, 1], "RwkvBlock without an attention module"),)),
    "recurrent-gemma": ("refused", (([0], "RecurrentGemmaRecurrentBlock"),)),
}


@pytest.mark.parametrize("name", SPECS)
def test_every_family_decodes_as_generate_or_is_refused_naming_its_layers(name, tmp_path):
    """A tiny random model of each family, saved with ``save_pretrained`` and decoded plainly by
    ``dspark.generate``: the fused ``TargetLM`` or ``HFTarget`` gives transformers' greedy tokens,
    or the target is refused before any decoding, naming the model class, the layers and their
    type -- never a silently different decode (hybrid layers keep a state the KV cache does not)."""
    import dspark

    outcome, groups = OUTCOMES[name]
    model = _model(name, TINY)
    model.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    prompt, n = PROMPTS[0], 16
    if outcome == "equal":
        result = dspark.generate(str(tmp_path), None, prompt, max_new_tokens=n, no_draft=True, ignore_eos=True)
        assert result.token_ids == _generate(model, prompt, n)
        return
    with pytest.raises(ValueError, match=re.escape(f"HFTarget: {type(model).__name__}: layers ")) as refusal:
        dspark.generate(str(tmp_path), None, prompt, max_new_tokens=n, no_draft=True, ignore_eos=True)
    message = str(refusal.value)
    assert REFUSAL in message
    for layers, what in groups:
        assert re.search(rf"layers {re.escape(str(layers))} are [^;.]*{re.escape(what)}", message), message
    assert message.count("layers [") == len(groups), message


def test_hybrid_layers_are_found_from_the_config_or_the_modules_alone():
    """A config that declares every layer softmax attention does not hide a convolution layer, and
    a declared non-attention layer is refused even where the modules look like attention."""
    lfm2 = _model("lfm2")
    lfm2.config.layer_types = ["full_attention"] * 3
    with pytest.raises(ValueError, match=re.escape("Lfm2ForCausalLM: layers [0, 2] are Lfm2ShortConv. " + REFUSAL)):
        HFTarget(lfm2)
    mistral = _model("mistral")
    mistral.config.layer_types = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=re.escape("MistralForCausalLM: layers [1] are 'linear_attention'. ")):
        HFTarget(mistral)


def test_the_fused_runner_refuses_layers_that_are_not_attention():
    """``TargetLM`` (chosen by model type: llama / qwen2 / qwen3) runs softmax attention only: a
    Qwen3 config declaring another layer type is refused, not run as attention."""
    import transformers as t

    config = t.Qwen3Config(**COMMON, **KV, head_dim=8,
                           layer_types=["full_attention", "linear_attention", "full_attention", "full_attention"])
    with pytest.raises(ValueError, match=re.escape("runs softmax attention layers only, got layer types "
                                                   "['linear_attention'] (layers [1])")):
        LLMEngine(t.Qwen3ForCausalLM(config), None, EngineConfig(max_batch=2))


def _falcon():
    import transformers as t

    size = {key: value for key, value in TINY.items() if key != "intermediate_size"}  # Falcon's is ffn_hidden_size
    return t.FalconForCausalLM(t.FalconConfig(**size, layer_norm_epsilon=3e-5, new_decoder_architecture=True,
                                              num_kv_heads=2, ffn_hidden_size=96))


@pytest.mark.parametrize("build, expected", [
    (lambda: _model("gpt-neox", {**TINY, "layer_norm_eps": 1e-3}),  # MHA without head_dim: hidden // heads
     dict(rms_norm_eps=1e-3, num_key_value_heads=4, head_dim=16, intermediate_size=128)),
    (lambda: _model("nemotron-h", {**TINY, "layer_norm_epsilon": 2e-4}),
     dict(rms_norm_eps=2e-4, num_key_value_heads=2, head_dim=16, intermediate_size=128)),
    (_falcon, dict(rms_norm_eps=3e-5, num_key_value_heads=2, head_dim=16, intermediate_size=96)),
], ids=["gpt-neox", "nemotron-h", "falcon"])
def test_a_drafter_is_built_for_a_target_of_any_family(build, expected):
    """``draft_config`` (``dspark train``'s) copies the norm epsilon, heads, head_dim and MLP width
    under the names each family gives them, and the drafter builds for that target."""
    from dspark.model import check_target_compatible
    from dspark.training.trainer import draft_config, new_draft

    model = build()
    config = draft_config(model.config, mask_token_id=TINY["vocab_size"] - 1, block_size=4, markov_rank=4)
    assert {key: getattr(config, key) for key in expected} == expected
    assert config.num_attention_heads == 4
    check_target_compatible(config, model.config)
    assert new_draft(model, config).config.rms_norm_eps == expected["rms_norm_eps"]


def test_a_target_config_without_a_norm_epsilon_is_named():
    import transformers as t

    from dspark.training.trainer import draft_config

    with pytest.raises(ValueError, match=re.escape("draft_config: the target's OPTConfig has no rms_norm_eps "
                                                   "(looked for rms_norm_eps / layer_norm_eps / layer_norm_epsilon")):
        draft_config(t.OPTConfig(**{**TINY, "ffn_dim": 128}), mask_token_id=0)


def test_graphability_is_declared_from_the_config():
    """Families whose transformers code synchronises the host say so up front (the runner then
    never tries a capture): dynamic / LongRoPE frequencies, experts that loop on the host."""
    import transformers as t

    assert all(HFTarget(_model(name)).graphable for name in FAMILIES if name not in MOE)
    moe = _model("qwen3-moe")
    moe.config._experts_implementation = "grouped_mm"  # transformers 5's default where torch has the kernel
    assert "'grouped_mm' in torch.float32" in HFTarget(moe).eager_reason
    assert HFTarget(moe.to(torch.bfloat16)).graphable  # one grouped GEMM kernel in bf16
    moe.config._experts_implementation = "batched_mm"
    assert HFTarget(moe).graphable
    moe.config._experts_implementation = "eager"
    assert "'eager' loops over the experts" in HFTarget(moe).eager_reason
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    for kind, model in (("dynamic", t.MistralForCausalLM(t.MistralConfig(**COMMON, rope_parameters={
                            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))),
                        ("longrope", t.Phi3ForCausalLM(t.Phi3Config(**COMMON, rope_parameters=longrope)))):
        target = HFTarget(model)
        assert not target.graphable and f"RoPE type '{kind}'" in target.eager_reason


# a value read on the host, a shape from device values, a tensor made from host data (a copy in the graph)
_SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
          "unique_consecutive", "repeat_interleave", "lift_fresh", "lift_fresh_copy"}


def test_the_forward_of_graphable_families_reads_nothing_on_the_host(monkeypatch):
    """What a CUDA graph cannot hold, seen on the CPU: no op of a graphable family's forward (ours
    and transformers', dspark's attention kernel aside) reads a device value on the host or sizes
    a tensor from one, nor makes a tensor from host data -- a mixed two-request forward with
    captures and selected logits."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from dspark.model import hf_target
    from dspark.model.llama import AttentionBatch

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            boolean_index = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
            if name in _SYNCS and "output_size" not in (kwargs or {}) or boolean_index:
                self.ops.add(name)
            return func(*args, **(kwargs or {}))

    attention = hf_target.K.cached_attention

    def kernel(*args, **kwargs):  # the CPU reference of dspark's kernel checks its inputs on the host
        with _disable_current_modes():
            return attention(*args, **kwargs)

    monkeypatch.setattr(hf_target.K, "cached_attention", kernel)
    for name in FAMILIES:
        target = HFTarget(_model(name), [0, 2])
        if not target.graphable:
            continue
        i32 = dict(dtype=torch.int32)
        batch = AttentionBatch(torch.tensor([1, 2], **i32), torch.tensor([0, 3], **i32), torch.tensor([0, 3, 6], **i32),
                               3)
        inputs = (torch.arange(6), torch.arange(6, **i32), torch.tensor([1, 1, 1, 2, 2, 2], **i32), batch,
                  target.new_cache(3, 16))
        capture, rows, recorder = torch.empty(6, 64), torch.tensor([2, 5]), Recorder()
        with recorder:
            target.forward(*inputs, capture_out=capture, logits_rows=rows)
        assert not recorder.ops, (name, recorder.ops)


class _FakeGraphs:
    """``torch.cuda``'s graph API on the CPU: a capture runs nothing (it records: the runner's
    ``fn`` inside it is discarded) and leaves its capture stream current when it fails, as
    ``torch.cuda.graph`` does when ``capture_end`` raises."""

    def __init__(self, monkeypatch):
        self.capturing, self.stream, self.captures = False, "main", 0
        fakes = self

        class Graph:
            def pool(self):
                return None

            def replay(self):
                raise AssertionError("no capture succeeded, so nothing replays")

        class capture:
            def __init__(self, graph, pool=None):
                pass

            def __enter__(self):
                fakes.capturing, fakes.stream = True, "capture"
                fakes.captures += 1

            def __exit__(self, kind, *rest):
                fakes.capturing = False
                if kind is None:
                    fakes.stream = "main"
                return False

        for attr, value in (("CUDAGraph", Graph), ("graph", capture), ("synchronize", lambda device=None: None),
                            ("current_stream", lambda device=None: fakes.stream),
                            ("set_stream", lambda stream: setattr(fakes, "stream", stream))):
            monkeypatch.setattr(torch.cuda, attr, value)


@pytest.mark.parametrize("noticed", [True, False], ids=["in-the-forward", "elsewhere"])
def test_a_failed_capture_runs_eagerly_with_the_same_tokens(monkeypatch, noticed):
    """A target forward that raises inside a capture (as transformers' code does when it reads a
    device value) makes the target eager after that one capture (``eager_reason`` set, no graph
    from then on); a capture that fails where the target cannot tell makes that graph eager. Either
    way: the same tokens as ``generate()``, the model's own attention and hooks restored, the
    capture stream given back."""
    from dspark.model import hf_target

    model = _model("mistral")
    expected = [_generate(model, p, NEW) for p in PROMPTS]
    fakes = _FakeGraphs(monkeypatch)
    monkeypatch.setattr(hf_target, "_capturing", lambda device: noticed and fakes.capturing)

    def sync_inside_capture(module, args):
        if fakes.capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    model.model.layers[1].register_forward_pre_hook(sync_inside_capture)
    engine = LLMEngine(model, None, EngineConfig(max_batch=3, max_num_batched_tokens=3 * 5 + 4))
    engine.runner.use_graphs = True
    assert [r.token_ids for r in engine.generate([Request(p, NEW) for p in PROMPTS])] == expected
    runner = engine.runner
    assert fakes.captures == len(runner.uncapturable) and not runner.graphs
    assert (len(runner.uncapturable) == 1) == noticed and runner.use_graphs != noticed
    assert noticed == ("failed inside a CUDA graph capture (RuntimeError" in (engine.target.eager_reason or ""))
    assert {key[0] for key in runner.uncapturable} <= {"decode", "mixed"} and fakes.stream == "main"
    assert hf_target._STEP.get(None) is None and model.config._attn_implementation != hf_target.ATTENTION
    assert [len(layer._forward_pre_hooks) for layer in model.model.layers] == [0, 1, 0, 0]


def _cuda_expected(model):
    """transformers' greedy ``generate()`` of every prompt on the GPU."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_graphs_greedy_equals_transformers_generate(name):
    """On the GPU (fp32, the Triton kernels: sliding windows included, CUDA graphs on): the same
    tokens as transformers' ``generate()`` on the same device, with a draft and without; the
    families declared graphable replay graphs and none failed its capture (fp32 Qwen3-MoE: eager,
    declared)."""
    if name in DELTANET:
        pytest.importorskip("fla", reason="gated DeltaNet on a GPU runs flash-linear-attention's kernel (fla-core)")
    model = _model(name)
    drafter = _drafter(model).to("cuda")
    expected = _cuda_expected(model.to("cuda"))
    for draft in (drafter, None):
        engine = LLMEngine(model, draft, EngineConfig(max_batch=3, max_num_batched_tokens=3 * 5 + 4))
        assert engine.runner.device.type == "cuda"
        assert [r.token_ids for r in engine.generate([Request(p, NEW) for p in PROMPTS])] == expected, name
        runner = engine.runner
        assert engine.target.graphable == (name not in MOE), engine.target.eager_reason
        assert bool(runner.graphs) == engine.target.graphable and not runner.uncapturable, (name, runner.uncapturable)
        if engine.target.graphable:
            assert {key[0] for key in runner.graphs} >= ({"verify", "draft"} if draft is not None else {"decode"})


@pytest.mark.gpu
def test_cuda_a_capture_that_synchronises_falls_back_eagerly():
    """A forward that reads a device value on the host (``.item()``, as some transformers code
    does) cannot be captured: after that one failed capture the target is eager (``eager_reason``)
    and every step runs without graphs, with the same tokens as ``generate()``; the engine's
    stream stays the default one."""
    model = _model("mistral")
    drafter = _drafter(model).to("cuda")
    expected = _cuda_expected(model.to("cuda"))

    def synchronise(module, args):
        args[0].sum().item()

    model.model.layers[1].register_forward_pre_hook(synchronise)
    for draft in (drafter, None):
        engine = LLMEngine(model, draft, EngineConfig(max_batch=3, max_num_batched_tokens=3 * 5 + 4))
        assert engine.target.graphable
        assert [r.token_ids for r in engine.generate([Request(p, NEW) for p in PROMPTS])] == expected
        runner = engine.runner
        assert len(runner.uncapturable) == 1 and not runner.use_graphs, runner.uncapturable
        assert "failed inside a CUDA graph capture" in engine.target.eager_reason
        assert torch.cuda.current_stream() == torch.cuda.default_stream()


@pytest.mark.gpu
def test_cuda_bf16_mixture_of_experts_replays_graphs():
    """Qwen3-MoE in bf16 (transformers' grouped GEMM experts, one kernel): declared graphable, its
    graphs captured and replayed, the same tokens as the same engine without graphs."""
    model = _model("qwen3-moe").to("cuda", torch.bfloat16)
    model.config._experts_implementation = "grouped_mm"  # transformers 5's default on this device
    eager = LLMEngine(model, None, EngineConfig(max_batch=3, cuda_graphs=False))
    expected = [r.token_ids for r in eager.generate([Request(p, NEW) for p in PROMPTS])]
    engine = LLMEngine(model, None, EngineConfig(max_batch=3))
    assert engine.target.graphable, engine.target.eager_reason
    assert [r.token_ids for r in engine.generate([Request(p, NEW) for p in PROMPTS])] == expected
    assert engine.runner.graphs and not engine.runner.uncapturable, engine.runner.uncapturable
