"""``SpeculativeDecoder``: one prompt at a time on the ``"reference"`` ``LLMEngine`` (a thin wrapper).

The API of dspark's first releases, kept for code that uses it::

    decoder = SpeculativeDecoder.from_pretrained(target_dir, draft_dir)
    result = decoder.generate(prompt_ids, max_new_tokens=64)   # a GenerationResult

Everything runs in ``LLMEngine`` (``max_batch`` 1, no CUDA graphs): the same stopping rules,
sampling and request-stable random stream as every other way of running a request, so one seed gives
the same tokens here as in a batch.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from ..kernels._validate import Checker
from .drafting import SamplingParams
from .llm_engine import EngineConfig, LLMEngine
from .request import GenerationResult, Request
from .target import load_target_model, resolve_device

__all__ = ["SpeculativeDecoder", "check_token_ids"]


class SpeculativeDecoder:
    """Speculative decoding of one prompt per ``generate`` call on ``engine`` (an ``LLMEngine``)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.num_drafts = engine.num_drafts

    @classmethod
    def from_models(cls, target_model, draft_model, *, max_model_len: int | None = None,
                    **drafter_options) -> "SpeculativeDecoder":
        """Pair a loaded causal LM with a ``DSparkDraftModel`` (checked compatible); ``drafter_options``
        (``scheduler``, ``threshold``, ``min_proposal_len``, ``max_proposal_len``) as ``EngineConfig``."""
        config = EngineConfig(max_batch=1, cuda_graphs=False, max_model_len=max_model_len, **drafter_options)
        return cls(LLMEngine(target_model, draft_model, config))

    @classmethod
    def from_pretrained(cls, target, draft, *, device=None, dtype=None, max_model_len: int | None = None,
                        allow_pickle: bool = False, **drafter_options) -> "SpeculativeDecoder":
        """``from_models`` after loading what is not loaded yet: ``target`` a Hugging Face causal-LM
        directory (``load_target_model``; ``allow_pickle`` as there) or model, ``draft`` a DSpark
        directory or ``DSparkDraftModel``; directories load onto ``device`` (default: the device of
        the model passed in, else transformers' default) in ``dtype``."""
        if device is not None:
            device = resolve_device(device)
        elif not isinstance(draft, (str, os.PathLike)):
            device = draft.device
        if isinstance(target, (str, os.PathLike)):
            target = load_target_model(target, device=device, dtype=dtype, allow_pickle=allow_pickle)
        if isinstance(draft, (str, os.PathLike)):
            from ..model import load_draft

            draft = load_draft(draft, target=target, device=next(target.parameters()).device, dtype=dtype)
        return cls.from_models(target, draft, max_model_len=max_model_len, **drafter_options)

    def generate(self, prompt_ids, *, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 eos_token_id: int | Sequence[int] | None = None,
                 on_tokens: Callable[[list[int]], "bool | None"] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (ints or int tensor ``[T]``).

        Stops after an ``eos_token_id`` (default: the target's; ``[]``: none) or at the context
        limit. ``on_tokens`` receives each round's committed tokens (returning True ends the output).
        Greedy output equals the target's greedy decoding; sampled output is distributed as the
        target's (temperature / top-k / top-p filtered).
        """
        c = Checker("generate")
        if on_tokens is not None and not callable(on_tokens):
            c.fail(f"on_tokens must be callable, got {type(on_tokens).__name__}", TypeError)
        stops = () if eos_token_id is None else check_token_ids(c, "eos_token_id", eos_token_id,
                                                                self.engine.target.vocab_size)
        request = Request(prompt_ids, max_new_tokens, sampling, stops, ignore_eos=eos_token_id is not None)
        stream = None if on_tokens is None else (lambda _i, tokens: on_tokens(tokens))
        return self.engine.generate_requests([request], on_tokens=stream)[0]


def check_token_ids(c: Checker, name: str, ids, vocab_size: int | None = None) -> list[int]:
    """``ids`` (one token id or a sequence of them) as a list, each checked in ``[0, vocab_size)``."""
    import torch

    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (int, Sequence, set, frozenset)):
        c.fail(f"{name} must be a token id or a sequence of token ids, got {type(ids).__name__}", TypeError)
    high = None if vocab_size is None else vocab_size - 1
    return [c.integer(f"{name}[]" if not isinstance(ids, int) else name, i, low=0, high=high)
            for i in ([ids] if isinstance(ids, int) else ids)]
