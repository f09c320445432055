"""Every transformers family with a stateful sequence mixer has one outcome here: it runs exactly
(its tiny random model decodes as ``generate()`` in ``test_hf_target`` / ``test_hybrid_target``) or
``HFTarget`` refuses it before any decoding, naming the model, the layers, the class that holds the
state and why it is not run.

The list is checked against the installed transformers: each model directory whose modeling code
keeps a convolution / recurrent state (or names a linear-attention, RWKV or xLSTM mixer) is in
``FAMILIES``, so a release that adds one fails here until it is listed. Refused families are built
on the meta device from their default configs (real shapes, no weights): the refusal needs only
the modules.
"""

import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from test_hf_target import FAMILIES as DECODED
from test_hf_target import SPECS

from dspark.model.hf_target import HFTarget

# a modeling file that mentions one of these keeps a state beside (or instead of) a KV cache
_MARKERS = re.compile(r"conv_state|recurrent_state|ssm_state|LinearAttention|Lightning|Rwkv|xLSTM")
_SHARED = "a shared attention block (one attention module serving several layers"
_INNER_CONVS = "short convolutions inside its attention and MLP blocks"
# model directory -> ("runs", the SPECS name its tiny model decodes under)
#                  | ("refused", causal-LM model type, config settings, [(what the layers are, why)])
#                  | ("other", why it is outside this list)
FAMILIES = {
    **{directory: ("runs", name) for directory, name in (
        ("bamba", "bamba"), ("falcon_h1", "falcon-h1"), ("falcon_mamba", "falcon-mamba"),
        ("granitemoehybrid", "granite-moe-hybrid"), ("jamba", "jamba"), ("lara_mini", "lara-mini"), ("lfm2", "lfm2"),
        ("lfm2_moe", "lfm2-moe"), ("lfm3", "lfm3"), ("mamba", "mamba"), ("mamba2", "mamba2"),
        ("nemotron_h", "nemotron-h"), ("olmo_hybrid", "olmo-hybrid"), ("qwen3_5", "qwen3.5"),
        ("qwen3_5_moe", "qwen3.5-moe"), ("qwen3_next", "qwen3-next"))},
    "bailing_hybrid": ("refused", "bailing_hybrid", dict(num_hidden_layers=6), [
        ("BailingHybridDeltaAttention", "decaying per key channel")]),
    "kimi_linear": ("refused", "kimi_linear", {}, [("KimiLinearDeltaAttention", "decaying per key channel")]),
    "minimax": ("refused", "minimax", {}, [("MiniMaxLightningAttention", "lightning attention")]),
    "recurrent_gemma": ("refused", "recurrent_gemma", {}, [("RecurrentGemmaRecurrentBlock", "RG-LRU")]),
    "rwkv": ("refused", "rwkv", {}, [("RwkvBlock", "WKV recurrence")]),
    "xlstm": ("refused", "xlstm", {}, [("xLSTMBlock", "mLSTM")]),
    "zamba": ("refused", "zamba", {}, [("ZambaMambaMixer", "n_mamba_heads"), ("'hybrid'", _SHARED)]),
    "zamba2": ("refused", "zamba2", {}, [("'hybrid'", _SHARED)]),  # its Mamba-2 mixer is Bamba's
    "zaya": ("refused", "zaya", {}, [("ZayaCCAProjection", "compressed convolutional attention")]),
    "inkling": ("refused", "inkling_text", {}, [("InklingShortConvolution", _INNER_CONVS)]),
    "inkling2": ("refused", "inkling2_text", {}, [("Inkling2ShortConvolution", _INNER_CONVS)]),
    "inkling2_loop": ("refused", "inkling2_loop_text", {}, [("Inkling2LoopShortConvolution", _INNER_CONVS)]),
    "qwen4_exp": ("refused", "qwen4_exp_text", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2), [
        ("Qwen4ExpTextGatedDeltaNet", "n-gram embeddings"), ("'indexed_attention'", "key blocks an indexer picks")]),
    "deepseek_v4": ("other", "no recurrent state: its compressed attention layers are refused by their declared types"),
    "minimax_m3_vl": ("other", "no recurrent state: its Lightning Indexer picks attention blocks"),
    "glm5_next": ("other", "no causal-LM class (AutoModelForCausalLM cannot load it)"),
    "auto": ("other", "transformers' auto classes"),
}


def _transformers_models() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


LISTED_FOR = "5.25.0"  # the newest transformers whose modeling files were read for FAMILIES


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_every_stateful_family_of_the_installed_transformers_is_listed():
    """Each model directory whose modeling code keeps a recurrent / convolution state has an outcome
    here, and each family listed as running decodes as ``generate()`` in ``test_hf_target``."""
    import transformers as t

    stateful = {path.parent.name for path in _transformers_models().glob("*/modeling_*.py")
                if _MARKERS.search(path.read_text(encoding="utf-8"))}
    unlisted = stateful - set(FAMILIES)
    # a later transformers may add families: named here (pytest -ra prints it), and refused at run time by
    # HFTarget's generic check until listed -- a new release must not fail everyone's test run
    if unlisted and _version(t.__version__) > _version(LISTED_FOR):
        pytest.skip(f"transformers {t.__version__} (newer than {LISTED_FOR}) has stateful families not listed "
                    f"here: {sorted(unlisted)}")
    assert unlisted == set()
    runs = {outcome[1] for outcome in FAMILIES.values() if outcome[0] == "runs"}
    assert runs <= set(DECODED) and runs <= set(SPECS)


@pytest.mark.parametrize("directory", [d for d, outcome in FAMILIES.items() if outcome[0] == "refused"])
def test_a_refused_family_is_refused_naming_its_layers_and_why(directory):
    """A family of each refused mixer (default config, or a small one where the default does not
    build): ``HFTarget`` refuses it naming the model class, the layers' mixer and why."""
    import transformers as t
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _, model_type, settings, expected = FAMILIES[directory]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {t.__version__} has no {model_type}")
    config = getattr(t, CONFIG_MAPPING_NAMES[model_type])(**settings)
    with torch.device("meta"):
        model = getattr(t, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config)
    with pytest.raises(ValueError, match=re.escape(f"HFTarget: {type(model).__name__}: layers ")) as refusal:
        HFTarget(model)
    message = str(refusal.value)
    for what, why in expected:
        assert re.search(rf"layers \[[0-9, ]+\] are [^;]*{re.escape(what)}[^;]*{re.escape(why)}", message), message


def test_an_attention_free_target_has_no_kv_and_its_blocks_only_account_positions():
    """Mamba (every layer a Mamba-1 mixer): its KV cache holds nothing, and on a GPU the memory
    budget (target K/V per block, none here) leaves the block count to ``max_batch`` full lines
    instead of dividing by zero bytes."""
    from types import SimpleNamespace

    from test_hf_target import _model

    from dspark.engine.block_manager import WorkingMemory, kv_blocks_from_memory
    from dspark.engine.llm_engine import EngineConfig

    target = HFTarget(_model("mamba"))
    assert sorted(target.stateful) == [0, 1, 2] and target.kv_bytes_per_token == 0
    assert target.new_cache(2, 16).k.numel() == 0
    on_gpu = SimpleNamespace(kv_bytes_per_token=0, device=torch.device("cuda"))
    assert kv_blocks_from_memory(on_gpu, None, EngineConfig(gpu_memory_utilization=0.9),
                                 WorkingMemory(*[0] * len(fields(WorkingMemory)))) is None
