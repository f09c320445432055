"""The user-facing generation API: prompts as text or token ids, one or many; results with text.

``LLM(target, draft, ...)`` loads the models once; its ``generate(prompts, ...)`` (and the one-call
``generate(target, draft, prompts, ...)`` built on it) turns each prompt into a ``Request`` (a string is
tokenized with the target's tokenizer), runs them through its ``LLMEngine`` and decodes each
continuation into ``GenerationResult.text``. Stop strings end a request once its decoded text
contains one: the text is cut before it, the token ids end with the token that completed it, and
the finish reason is ``"stop"`` (statistics count every token the engine committed).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from ..kernels._validate import Checker
from .config import DEFAULT_DRAFT_CANDIDATES, DEFAULT_DRAFT_SUCCESSORS
from .decoder import check_token_ids
from .llm_engine import LLMEngine, engine_config
from .request import GenerationInterrupted, GenerationResult, Request
from .target import load_target_model, resolve_device
from .drafting import SamplingParams
from .penalties import MAX_BAD_WORD_TOKENS
from .structured import StructuredOutputs
from .text import TextStream

__all__ = ["LLM", "generate", "generate_texts", "load_tokenizer", "encode_bad_words", "encode_prompts",
           "TOKENIZER_FILES"]

log = logging.getLogger("dspark.engine")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path):
    """The tokenizer of the checkpoint directory ``path`` (``AutoTokenizer``), or None when it has none."""
    # transformers builds an empty tokenizer for a directory without tokenizer files: look first.
    if path is None or not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def encode_prompts(prompts, tokenizer, *, name: str = "generate") -> tuple[list[list[int]], bool]:
    """``(token id lists, single)`` of ``prompts``: one prompt (a string, a sequence of token ids or
    a 1-D int tensor; ``single`` True) or a list of prompts (a nested list of ids is a batch, never
    concatenated; a 2-D tensor is a batch of rows). Strings are tokenized with ``tokenizer`` (no
    special tokens added)."""
    c = Checker(name)
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() not in (1, 2):
            c.fail(f"a prompt tensor must be 1-D (one prompt) or 2-D (a batch), got shape {list(prompts.shape)}")
        return (([prompts.tolist()], True) if prompts.dim() == 1 else (prompts.tolist(), False))
    if isinstance(prompts, str):
        return [_encode(c, prompts, tokenizer, 0)], True
    if not isinstance(prompts, Sequence):
        c.fail(f"prompts must be a string, a list of token ids or a list of prompts, got {type(prompts).__name__}",
               TypeError)
    if not prompts:
        c.fail("prompts must hold at least one prompt (or token id), got an empty list")
    ids = [isinstance(p, int) and not isinstance(p, bool) for p in prompts]
    if all(ids):
        return [list(prompts)], True
    if any(ids):
        c.fail("prompts mixes token ids and prompts: give one list of ids, or a list whose every item is a prompt",
               TypeError)
    batch = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            batch.append(_encode(c, prompt, tokenizer, i))
        elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            batch.append(prompt.tolist())
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            batch.append(list(prompt))
        else:
            c.fail(f"prompt {i} must be a string or a flat list of token ids, got {type(prompt).__name__}", TypeError)
    return batch, False


def encode_bad_words(words, tokenizer, *, name: str = "generate") -> tuple[tuple[int, ...], ...]:
    """vLLM's token sequences of the ``bad_words`` strings: each word (its leading spaces stripped)
    tokenized as it is (the start of the output) and, when a leading space makes other tokens of
    the same count, with one (a word inside the text). ValueError / TypeError naming the word (an
    empty one, one longer than ``MAX_BAD_WORD_TOKENS``, no tokenizer)."""
    c = Checker(name)
    if isinstance(words, str) or not isinstance(words, Sequence) or not all(isinstance(w, str) for w in words):
        c.fail(f"bad_words must be a list of strings, got {words!r}"[:200], TypeError)
    if words and tokenizer is None:
        c.fail("bad_words are text and need the target's tokenizer, and it has none")
    sequences = []
    for i, word in enumerate(words):
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            c.fail(f"bad_words[{i}] is empty: it has no tokens")
        if len(plain) > MAX_BAD_WORD_TOKENS:
            c.fail(f"bad_words[{i}] ({word[:40]!r}) is {len(plain)} tokens; at most {MAX_BAD_WORD_TOKENS} are "
                   "supported")
        sequences.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(tuple(spaced))
    return tuple(sequences)


def generate_texts(engine: LLMEngine, requests: Sequence[Request], tokenizer, *, stop: Sequence[str] = (),
                   on_tokens: Callable[[int, list[int]], "bool | None"] | None = None,
                   on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
    """``engine.generate_requests`` with text: with a ``tokenizer`` every result carries ``.text`` and the
    ``stop`` strings end requests (see the module docstring). ``on_tokens(i, tokens)`` streams
    request i's tokens (returning True ends it); ``on_text(i, text)`` its newly final text.
    ``GenerationInterrupted`` carries partial results with their text."""
    c = Checker("generate")
    stop = _stop_strings(c, stop)
    for name, value in (("on_tokens", on_tokens), ("on_text", on_text)):
        if value is not None and not callable(value):
            c.fail(f"{name} must be callable, got {type(value).__name__}", TypeError)
    if tokenizer is None and (stop or on_text is not None):
        c.fail("stop strings and text streaming need the target's tokenizer, and it has none")
    streams = None if tokenizer is None else [TextStream(tokenizer, r.prompt_ids, stop, r.sampling.min_tokens,
                                                         r.stop_ids) for r in requests]

    def callback(i: int, tokens: list[int]) -> bool:
        stopped = bool(on_tokens(i, tokens)) if on_tokens is not None else False
        if streams is not None:
            stopped = streams[i].add(tokens) or stopped
            if on_text is not None and (text := streams[i].take()):
                on_text(i, text)
        return stopped

    live = on_tokens is not None or on_text is not None or bool(stop)
    try:
        results = engine.generate_requests(requests, on_tokens=callback if live else None)
    except GenerationInterrupted as exc:
        _finish(streams, exc.results, None)
        raise
    _finish(streams, results, on_text)
    return results


class LLM:
    """A target (and DSpark draft) loaded once, for many ``generate`` calls (like vLLM's ``LLM``).

    ``target``: a Hugging Face causal-LM directory (str or path) or loaded model; ``draft``: a
    DSpark checkpoint directory (speculators or DeepSpec format) or a ``DSparkDraftModel``; both
    None: the demo pair shipped with the package. ``no_draft=True`` decodes with the target alone
    (plain decoding, the baseline). ``tokenizer``: default the target directory's own (results then
    carry ``.text``). ``engine`` (``engine_config``): ``"batched"`` -- up to ``max_batch`` prompts
    decoded together, CUDA graphs on a GPU -- or ``"reference"`` -- one prompt at a time, eagerly --
    or ``"auto"`` (default): batched on CUDA, reference elsewhere; both are the same ``LLMEngine``
    (``self.decoder``), so outputs agree. ``max_model_len``: the context, prompt + output (default
    the target's ``max_position_embeddings``, at most 4096). Scheduling: ``scheduler`` / ``threshold``
    as ``Drafter``, or ``"cost"`` with ``cost_table`` (the JSON ``dspark profile`` writes, or an
    ``SPSCostTable``) and ``min_predicted_gain``; ``schedule_signal`` (``"confidence"`` or
    ``"online"``) what those schedulers read, as ``EngineConfig``. ``allow_pickle`` lets a target with only pickled
    weights load (only for a trusted checkpoint). ``device`` / ``dtype``: where directories are
    loaded (default: the device of a model passed in, else the CPU; dtype: float32 on a CPU, the
    checkpoint's half precision on a GPU, as ``default_dtype``). ``draft_top_k`` > 1: tree mode
    (DDTree) with ``tree_budget`` nodes per round (0: block size + 1), and ``draft_candidates`` /
    ``draft_successors`` (sampled drafts over each slot's top-C drafter logits and the previous token's
    Markov successors; 0: the vocabulary), as ``EngineConfig``. On a GPU
    every CUDA graph the engine replays is captured here, before the first call (one log line,
    ``dspark.engine``: how many and how long), so that no call waits for a capture;
    ``enforce_eager=True`` (vLLM's name) captures none and runs every step eagerly. KV memory
    (``EngineConfig``): ``enable_prefix_caching`` (prompts that start alike share their blocks),
    ``gpu_memory_utilization`` (the fraction of the GPU's memory the engine may fill with KV blocks;
    None: blocks for ``max_batch`` requests of ``max_model_len``), ``num_kv_blocks``,
    ``kv_block_size``. ``tensor_parallel_size`` N > 1 (vLLM's name): the target sharded over N GPUs,
    one process each, driven by this one (``EngineConfig``; Llama / Qwen2 / Qwen3 targets); ``close()``
    stops them.
    """

    def __init__(self, target=None, draft=None, *, no_draft: bool = False, tokenizer=None, engine: str = "auto",
                 max_batch: int = 16, max_model_len: int | None = None, scheduler: str = "off", threshold: float = 0.0,
                 cost_table=None, min_predicted_gain: float = 0.04, allow_pickle: bool = False, device=None,
                 dtype=None, draft_top_k: int = 1, tree_budget: int = 0, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True, gpu_memory_utilization: float | None = 0.9,
                 num_kv_blocks: int | None = None, kv_block_size: int = 16,
                 draft_candidates: int = DEFAULT_DRAFT_CANDIDATES, draft_successors: int = DEFAULT_DRAFT_SUCCESSORS,
                 schedule_signal: str = "confidence", tensor_parallel_size: int = 1):
        c = Checker("LLM")
        target, draft = _models(c, target, draft, no_draft)
        self.tokenizer = _default_tokenizer(target) if tokenizer is None else tokenizer
        device = resolve_device(device) if device is not None else _model_device(target, draft)
        config = engine_config(engine, device, name="LLM", max_batch=c.integer("max_batch", max_batch, low=1),
                               max_model_len=max_model_len, scheduler=scheduler, threshold=threshold,
                               cost_table=cost_table, min_predicted_gain=min_predicted_gain, device=device,
                               dtype=dtype, draft_top_k=draft_top_k, tree_budget=tree_budget,
                               cuda_graphs=not c.boolean("enforce_eager", enforce_eager),
                               enable_prefix_caching=enable_prefix_caching,
                               gpu_memory_utilization=gpu_memory_utilization, num_kv_blocks=num_kv_blocks,
                               kv_block_size=kv_block_size, draft_candidates=draft_candidates,
                               draft_successors=draft_successors, schedule_signal=schedule_signal,
                               tensor_parallel_size=tensor_parallel_size)
        if allow_pickle and isinstance(target, str):  # the engine's own loader reads safetensors only
            target = load_target_model(target, device=device, dtype=dtype, allow_pickle=True)
        self.decoder = LLMEngine(target, draft, config)
        self.decoder.tokenizer = self.tokenizer  # what structured outputs compile against
        start = time.perf_counter()
        graphs = self.decoder.capture_graphs()  # none on a CPU or eagerly
        if graphs:
            log.info("captured %d CUDA graphs in %.1f s", graphs, time.perf_counter() - start)

    def generate(self, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, min_p: float = 0.0, logit_bias: Mapping[int, float] | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 min_tokens: int = 0, bad_words: Sequence[str] | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 ignore_eos: bool = False, stop: str | Sequence[str] | None = None,
                 on_tokens: Callable[[list[int]], "bool | None"] | None = None,
                 structured_outputs: StructuredOutputs | None = None, disable_spec_decode: bool = False
                 ) -> GenerationResult | list[GenerationResult]:
        """Generate for ``prompts``: one prompt -- a string (tokenized with the tokenizer), a list of
        token ids or a 1-D tensor -- or a list of prompts; returns one ``GenerationResult`` or a
        list of them in order, with ``.text`` when there is a tokenizer. The output ends after
        ``eos_token_id`` (default: the target's EOS; ``ignore_eos`` drops that default), a ``stop``
        string, ``max_new_tokens`` tokens, or the context. ``on_tokens(tokens)`` streams a single
        prompt's tokens as they are accepted. Sampling as vLLM's sampler (``SamplingParams``):
        ``logit_bias`` (token id -> bias in [-100, 100], added to the logits, greedy decoding's too),
        ``min_tokens`` (the EOS / stop ids banned, stop strings not matched, until that many tokens
        were generated), ``bad_words`` (strings never generated: ``encode_bad_words``),
        ``repetition_penalty`` (> 0, over prompt and output), ``frequency_penalty`` and
        ``presence_penalty`` (in [-2, 2], over the output), ``temperature`` (0 = greedy), ``min_p``,
        ``top_k``, ``top_p`` (the standard nucleus), ``seed``. ``structured_outputs``: what every
        output must match (``StructuredOutputs``: a JSON schema, any JSON object, a regex, a choice,
        an EBNF grammar); the output ends when it is complete. ``disable_spec_decode``: these requests
        verify no draft (plain decoding on the DSpark engine, exact as ever)."""
        c = Checker("generate")
        if on_tokens is not None and not callable(on_tokens):
            c.fail(f"on_tokens must be callable, got {type(on_tokens).__name__}", TypeError)
        stop = _stop_strings(c, stop)
        sampling = SamplingParams(temperature, top_k, top_p, seed, min_p, logit_bias or (), structured_outputs,
                                  presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                  repetition_penalty=repetition_penalty, min_tokens=min_tokens,
                                  bad_words=encode_bad_words(bad_words or (), self.tokenizer))
        batch, single = encode_prompts(prompts, self.tokenizer)
        if on_tokens is not None and not single:
            c.fail(f"on_tokens streams a single prompt; got a list of {len(batch)} prompts")
        stop_ids = () if eos_token_id is None else check_token_ids(c, "eos_token_id", eos_token_id,
                                                                   self.decoder.target.vocab_size)
        requests = [Request(ids, max_new_tokens, sampling, stop_ids, ignore_eos or eos_token_id is not None,
                            disable_spec_decode=disable_spec_decode) for ids in batch]
        stream = None if on_tokens is None else (lambda _i, tokens: on_tokens(tokens))
        results = generate_texts(self.decoder, requests, self.tokenizer, stop=stop, on_tokens=stream)
        return results[0] if single else results

    def close(self) -> None:
        """Stop the engine's other tensor-parallel processes (nothing on one GPU); no call after this."""
        self.decoder.close()


def generate(target, draft, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, min_p: float = 0.0, logit_bias: Mapping[int, float] | None = None,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
             min_tokens: int = 0, bad_words: Sequence[str] | None = None, scheduler: str = "off",
             threshold: float = 0.0,
             eos_token_id: int | Sequence[int] | None = None, ignore_eos: bool = False,
             stop: str | Sequence[str] | None = None, on_tokens: Callable[[list[int]], "bool | None"] | None = None,
             structured_outputs: StructuredOutputs | None = None, tokenizer=None, max_model_len: int | None = None, allow_pickle: bool = False, device=None,
             dtype=None, engine: str = "auto", max_batch: int = 64, no_draft: bool = False, cost_table=None,
             min_predicted_gain: float = 0.04, draft_top_k: int = 1, tree_budget: int = 0, enforce_eager: bool = False,
             enable_prefix_caching: bool = True, gpu_memory_utilization: float | None = 0.9,
             num_kv_blocks: int | None = None, kv_block_size: int = 16) -> GenerationResult | list[GenerationResult]:
    """One-call speculative generation (``dspark.generate``): ``LLM(target, draft, ...)`` for these
    prompts alone, then its ``generate`` -- the models are loaded on every call, so for many calls
    build an ``LLM`` once. The arguments are ``LLM``'s and ``LLM.generate``'s (``target`` and
    ``draft`` both None: the demo pair); the batched engine is sized to the prompts (at most
    ``max_batch`` at once). ``draft_top_k`` > 1: tree mode (DDTree) with ``tree_budget`` nodes per
    round (0: block size + 1), as ``LLM``; ``enforce_eager`` as ``LLM`` (a single call may well run
    faster without the start-up capture); the KV options as ``LLM``."""
    c = Checker("generate")
    target, draft = _models(c, target, draft, no_draft)
    tokenizer = _default_tokenizer(target) if tokenizer is None else tokenizer
    batch, _ = encode_prompts(prompts, tokenizer)
    llm = LLM(target, draft, no_draft=no_draft, tokenizer=tokenizer, engine=engine,
              max_batch=min(c.integer("max_batch", max_batch, low=1), len(batch)), max_model_len=max_model_len,
              scheduler=scheduler, threshold=threshold, cost_table=cost_table, min_predicted_gain=min_predicted_gain,
              allow_pickle=allow_pickle, device=device, dtype=dtype, draft_top_k=draft_top_k,
              tree_budget=tree_budget, enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
              gpu_memory_utilization=gpu_memory_utilization, num_kv_blocks=num_kv_blocks, kv_block_size=kv_block_size)
    return llm.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, min_p=min_p, logit_bias=logit_bias, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                        min_tokens=min_tokens, bad_words=bad_words, eos_token_id=eos_token_id, ignore_eos=ignore_eos,
                        stop=stop, on_tokens=on_tokens, structured_outputs=structured_outputs)


def _models(c: Checker, target, draft, no_draft: bool):
    """``(target, draft)`` checked: each a directory (str or path, returned as str) or a loaded
    model; both None the demo pair (its target alone with ``no_draft``); ``draft`` None only with
    ``no_draft``. TypeError / ValueError naming the argument, what it takes and what was given."""
    from ..model import DSparkDraftModel
    from ..model.checkpoint import check_config_files

    target, draft = (os.fspath(m) if isinstance(m, os.PathLike) else m for m in (target, draft))
    if not isinstance(no_draft, bool):
        c.fail(f"no_draft must be a bool, got {type(no_draft).__name__}", TypeError)
    if target is not None and not isinstance(target, (str, torch.nn.Module)):
        c.fail(f"target must be a checkpoint directory (str or path), a loaded causal LM or None (the demo pair), "
               f"got {type(target).__name__}", TypeError)
    if draft is not None and not isinstance(draft, (str, DSparkDraftModel)):
        c.fail(f"draft must be a DSpark checkpoint directory (str or path), a DSparkDraftModel or None, "
               f"got {type(draft).__name__}", TypeError)
    if no_draft and draft is not None:
        c.fail(f"no_draft=True decodes with the target alone, but a draft was given ({_describe(draft)})")
    if target is None:
        if draft is not None:
            c.fail(f"draft {_describe(draft)} needs its target: target is None (both None run the demo pair)")
        from ..training.data import demo_pair

        pair = demo_pair()
        return str(pair.target), None if no_draft else str(pair.draft)
    if draft is None and not no_draft:
        c.fail(f"target {_describe(target)} needs a draft: draft is None (pass a DSpark checkpoint directory or "
               f"DSparkDraftModel, no_draft=True for plain decoding, or neither model for the demo pair)")
    check_config_files((m for m in (target, draft) if isinstance(m, str)), c)  # before the loaders
    return target, draft


def _describe(model) -> str:
    return repr(model) if isinstance(model, str) else f"a {type(model).__name__}"


def _default_tokenizer(target):
    """The tokenizer of the target directory, or of the directory a loaded model came from."""
    return load_tokenizer(target if isinstance(target, str) else getattr(target, "name_or_path", None))


def _model_device(target, draft) -> torch.device | None:
    """The device of whichever of ``target`` / ``draft`` is a loaded model (None for paths)."""
    for model in (target, draft):
        if isinstance(model, torch.nn.Module):
            return next(model.parameters()).device
    return None


def _encode(c: Checker, text: str, tokenizer, index: int) -> list[int]:
    if tokenizer is None:
        c.fail("a text prompt needs the target's tokenizer, and the target has none: pass token ids, or tokenizer=")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        c.fail(f"prompt {index} is empty: it has no tokens")
    return ids


def _stop_strings(c: Checker, stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
        c.fail(f"stop must be a non-empty string or a list of them, got {stop!r}", TypeError)
    return tuple(stop)


def _finish(streams, results: list[GenerationResult], on_text) -> None:
    for i, result in enumerate(results):
        if streams is not None:
            streams[i].finish(result)
            if on_text is not None and (text := streams[i].take(final=True)):
                on_text(i, text)
