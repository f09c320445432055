"""Targets of other transformers families through ``LLMEngine`` (``HFTarget``: their own modeling
code on the engine's ragged tokens and KV cache).

Oracle: transformers' own greedy ``generate()``. Tiny random models (float32) of five families
beyond Llama / Qwen -- Mistral, Phi-3, a Qwen3 mixture of experts, GPT-NeoX (partial rotary, MHA,
parallel residual), OLMo-2 (norms after attention and MLP), and sliding-window Mistral and Gemma 3
(windows of 4-5 tokens, Gemma's local/global layers) -- decode with a random DSpark drafter
built for them and with plain decoding: greedy output identical to ``generate()``, each request the
same alone and in a batch, prompts chunked into running steps; a sampled request is the same alone
and in a batch. Attention soft-capping is refused with an error naming it.
"""

from types import SimpleNamespace

import pytest
import torch
from model_cases import random_draft, tiny_draft_config

from dspark.engine import SamplingParams
from dspark.engine.llm_engine import EngineConfig, LLMEngine
from dspark.engine.request import Request
from dspark.model.hf_target import HFTarget

VOCAB, NEW = 96, 12
PROMPTS = [[3, 17, 42, 8, 61, 5], [9, 1], [44, 2, 71, 7, 7, 30, 12, 55, 90, 3, 18], [60]]
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)


def _family(name):
    import transformers as t

    kv = dict(num_key_value_heads=2)
    return {
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**COMMON, **kv, head_dim=8, sliding_window=None)),
        "phi3": lambda: t.Phi3ForCausalLM(t.Phi3Config(**COMMON, **kv)),
        "qwen3-moe": lambda: t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
            **COMMON, **kv, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1)),
        "gpt-neox": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**{**COMMON, "rotary_pct": 0.5},
                                                                 use_parallel_residual=True)),
        "olmo2": lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**COMMON, **kv)),
        # sliding layers with windows far below the outputs' length: every verify row and prompt
        # chunk spans window edges
        "mistral-sliding": lambda: t.MistralForCausalLM(t.MistralConfig(**COMMON, **kv, head_dim=8, sliding_window=5)),
        "gemma3-sliding": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(
            **{**COMMON, "num_hidden_layers": 4}, **kv, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    }[name]


FAMILIES = ["mistral", "phi3", "qwen3-moe", "gpt-neox", "olmo2", "mistral-sliding", "gemma3-sliding"]


def _model(name):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return _family(name)().eval()


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


def test_sampled_request_is_the_same_alone_and_in_a_batch(family):
    name, model, _ = family
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mistral-sliding", "gemma3-sliding", "qwen3-moe"])
def test_cuda_greedy_equals_transformers_generate(name):
    """On the GPU (fp32, the Triton kernels: sliding windows included): the same tokens as
    transformers' ``generate()`` on the same device."""
    model = _model(name)
    draft = _drafter(model).to("cuda")
    model.to("cuda")
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p in PROMPTS]
    for draft in (draft, None):
        engine = LLMEngine(model, draft, EngineConfig(max_batch=3, max_num_batched_tokens=3 * 5 + 4))
        assert engine.runner.device.type == "cuda"
        assert [r.token_ids for r in engine.generate([Request(p, NEW) for p in PROMPTS])] == expected, name
