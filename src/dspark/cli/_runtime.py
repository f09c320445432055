"""Options and helpers shared by the subcommands: the help format, ``--device`` / ``--dtype`` /
``--allow-pickle`` / ``--quiet``, checkpoint names (local directories, Hugging Face Hub names, the
demo pair by default), the target loader, sampling, stop-string and scheduler options, progress bars.

Nothing here imports torch or transformers at module level: ``dspark --help`` and every
``dspark <command> --help`` build their parsers from this module, and must stay fast."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The engine's schedulers (``dspark.engine.config.ENGINE_SCHEDULERS``), spelled out so that building
# a parser never imports the engine (and torch); tests/test_cli_runtime.py keeps the two equal.
SCHEDULER_CHOICES = ("off", "threshold", "sps", "cost")
SCHEDULE_SIGNALS = ("confidence", "online")  # ``dspark.engine.config.SCHEDULE_SIGNALS``, likewise
# ``dspark.engine.config.DEFAULT_DRAFT_CANDIDATES`` / ``_SUCCESSORS``, spelled out likewise
# (tests/test_candidate_drafting.py keeps them equal)
DEFAULT_DRAFT_CANDIDATES, DEFAULT_DRAFT_SUCCESSORS = 64, 16


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where it is None or False (nothing to show)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="models' dtype; auto: on cuda the target checkpoint's half precision (its config.json; else bfloat16), on cpu float32")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="load a target that has only pickled weights (pytorch_model.bin); unpickling can run "
                             "code from the file, so only for a checkpoint you trust (safetensors are always preferred)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no loading or progress bars")


def runtime(args: argparse.Namespace):
    """``(device, dtype)`` from ``--device`` / ``--dtype`` (ValueError for a device this machine
    lacks); with ``--quiet`` also silences transformers' loading bars and reports."""
    import torch

    from dspark.engine import default_dtype, resolve_device

    if args.quiet:
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()
    device = resolve_device(args.device, name="--device")
    if args.dtype == "auto":
        return device, default_dtype(device, getattr(args, "target", None))
    return device, getattr(torch, args.dtype)


# ---- checkpoint names: local directories, Hugging Face Hub names, the demo pair -------------------

# A Hub model id: "name" or "owner/name" of letters, digits, "-", "_", "." (huggingface_hub's rule),
# no "--" or "..". Anything else that is not a local path stays a path (and fails as one).
_HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
# What a checkpoint needs from a Hub repo: configs, safetensors weights, tokenizer files.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_checkpoint(name: str | None, flag: str, *, allow_pickle: bool = False) -> str | None:
    """The local directory of the checkpoint ``name`` given to ``flag`` (``--target`` / ``--draft``):
    ``name`` itself when it exists on disk (or is no Hub model id); else a Hugging Face Hub model id
    (``Qwen/Qwen3-0.6B``) looked up in the Hub cache first (``HF_HUB_CACHE``), then downloaded
    unless downloads are off (``HF_HUB_OFFLINE=1``); ``allow_pickle`` also fetches pickled weights
    (``*.bin``). None stays None (the caller's default). ValueError, one line naming the flag, the
    name and what to do, when it is neither on disk nor cached and cannot be downloaded."""
    if name is None or Path(name).expanduser().exists() or not _HUB_ID.fullmatch(name):
        return None if name is None else str(Path(name).expanduser())
    cached = _cached_hub_model(name)
    if cached is not None:
        return cached
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{flag} {name} is not a local directory, nor a Hugging Face Hub model in the cache "
                         f"({constants.HF_HUB_CACHE}), and downloads are off (HF_HUB_OFFLINE=1): download it "
                         f"where there is a network (hf download {name}) or give a local directory")
    patterns = _HUB_PATTERNS + (["*.bin"] if allow_pickle else [])
    try:
        return snapshot_download(name, allow_patterns=patterns)
    except Exception as exc:  # no such repo, a gated one, no network: every reason ends the same way
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{flag} {name} is not a local directory, and downloading it from the Hugging Face Hub "
                         f"failed ({type(exc).__name__}: {reason}): check the name, your network and "
                         f"access (hf auth login for a gated model), or give a local directory") from None


def resolve_pair(args: argparse.Namespace, *, drafts: str = "one", no_draft: bool | None = None) -> None:
    """Set ``args.target`` and ``args.draft`` to local directories (``resolve_checkpoint``); neither
    given: the demo pair shipped with the package; ``--draft`` alone: the verifier its config names
    (``draft_verifier``). ``drafts``: what ``--draft`` takes -- ``"one"`` directory, ``"several"``
    (a list) or ``"none"`` (a command of the target alone). A draft is trained for its target, so a
    target without a draft is refused, except with ``no_draft`` (plain decoding; None: the command
    has no ``--no-draft``). ``args.target_name`` keeps the target's name as given (a Hub id stays
    portable in what is written)."""
    draft = None if drafts == "none" else args.draft
    if no_draft and draft is not None:
        raise ValueError("--no-draft and --draft exclude each other")
    if args.target is not None and draft is None and drafts != "none" and not no_draft:
        plain = "" if no_draft is None else ", or --no-draft for plain decoding"
        raise ValueError(f"--target needs --draft, a DSpark draft trained for it{plain} (or neither, for the demo pair)")
    if args.target is None and draft is None:
        from dspark.training.data import demo_pair

        pair = demo_pair()
        args.target = args.target_name = str(pair.target)
        if drafts != "none" and not no_draft:
            args.draft = [str(pair.draft)] if drafts == "several" else str(pair.draft)
        return
    if drafts == "several":
        args.draft = [resolve_checkpoint(d, "--draft") for d in draft]
    elif draft is not None:
        args.draft = resolve_checkpoint(draft, "--draft")
    draft_dirs = args.draft if drafts == "several" else [] if draft is None else [args.draft]
    from dspark.model.checkpoint import check_config_files

    if args.target is None:
        check_config_files(draft_dirs)
        args.target_name, args.target = _one_verifier([draft_verifier(d, given) for d, given in zip(
            draft_dirs, draft if drafts == "several" else [draft])])
    else:
        args.target_name = args.target
        args.target = resolve_checkpoint(args.target, "--target", allow_pickle=getattr(args, "allow_pickle", False))
    check_config_files([args.target, *draft_dirs])


def draft_verifier(draft: str, given: str) -> tuple[str, str]:
    """``(name, local directory)`` of the verifier (target) that the draft directory ``draft``
    (``given`` to ``--draft``) names in its config.json -- speculators' ``speculators_config.
    verifier.name_or_path``; a DeepSpec config names none: a directory, absolute or relative (to
    the draft's directory, its parent, then the working directory), or a Hugging Face Hub model id
    in the local Hub cache (never downloaded: a draft's record is no reason to fetch a model).
    ValueError naming the draft, the verifier and where it looked."""
    from dspark.model.checkpoint import CONFIG_NAME, read_json_object

    config = read_json_object(Path(draft) / CONFIG_NAME) if (Path(draft) / CONFIG_NAME).is_file() else {}
    record = (config.get("speculators_config") or {}).get("verifier") or {}
    name = record.get("name_or_path") if isinstance(record, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"--draft needs --target: --draft {given} names no verifier in its config.json "
                         f"(speculators_config.verifier.name_or_path; DeepSpec configs name none): give --target, "
                         f"the model it drafts for (or neither, for the demo pair)")
    path = Path(name).expanduser()
    places = [path] if path.is_absolute() else [Path(draft) / path, Path(draft).parent / path, Path.cwd() / path]
    found = next((p for p in places if p.is_dir()), None)
    if found is not None:
        return str(found), str(found)
    cache = _cached_hub_model(name)
    if cache is not None:
        return name, cache
    from huggingface_hub import constants

    hub = f", nor a Hugging Face Hub model in the local cache ({constants.HF_HUB_CACHE})" if _HUB_ID.fullmatch(name) \
        else ""
    raise ValueError(f"--draft {given} names its verifier {name!r} (speculators_config.verifier.name_or_path), but it "
                     f"is not a directory (looked in {', '.join(str(p) for p in places)}){hub}: give --target, "
                     f"the model it drafts for")


def _cached_hub_model(name: str) -> str | None:
    """The local snapshot of the Hub model ``name`` in the Hub cache, or None (not an id, not cached)."""
    if not _HUB_ID.fullmatch(name):
        return None
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True)
    except OSError:  # LocalEntryNotFoundError (a FileNotFoundError): not in the cache
        return None


def _one_verifier(verifiers: list[tuple[str, str]]) -> tuple[str, str]:
    """The verifier all the drafts name (``dspark eval`` takes several drafts of one target)."""
    if len({directory for _, directory in verifiers}) > 1:
        raise ValueError(f"the drafts name different verifiers ({', '.join(name for name, _ in verifiers)}): "
                         f"give --target, the model they all draft for")
    return verifiers[0]


def load_target(args: argparse.Namespace, device, dtype):
    """``(model, tokenizer)`` of ``--target`` (a Hugging Face causal LM directory with its
    tokenizer), the model frozen on ``device``; ValueError naming what is wrong with it."""
    from dspark.engine import load_target_model, load_tokenizer

    model = load_target_model(args.target, device=device, dtype=dtype, allow_pickle=args.allow_pickle)
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        raise ValueError(f"--target {args.target} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return model.requires_grad_(False), tokenizer


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off, 1 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of most likely tokens holding this probability (vLLM's)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="in [0, 1]: keep the tokens at least this fraction as likely as the most likely one")
    parser.add_argument("--logit-bias", metavar="ID=BIAS", action="append", default=[],
                        help="add BIAS (in [-100, 100]) to token ID's logit before anything else, greedy decoding "
                             "included; repeat for more tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling uniforms")


def add_penalty_arguments(parser: argparse.ArgumentParser) -> None:
    """The controls that read the tokens so far (vLLM's; exact under speculative decoding too)."""
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="in [-2, 2]: subtracted from the logit of each token the output holds (OpenAI's)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="in [-2, 2]: subtracted from a token's logit once per time the output holds it")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 0: the logits of tokens in the prompt or output divided by it when positive, "
                             "multiplied when not (transformers' and vLLM's); 1 = off")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="ban the EOS and stop ids (and stop strings) until this many tokens were generated")
    parser.add_argument("--bad-words", metavar="TEXT", action="append", default=[],
                        help="never generate this text (its tokens, at the start or after a space, as vLLM); "
                             "repeatable; needs the tokenizer")


def penalty_settings(args: argparse.Namespace, tokenizer) -> dict:
    """The ``SamplingParams`` fields of ``add_penalty_arguments`` (bad words tokenized)."""
    from dspark.engine import encode_bad_words

    return dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
                bad_words=encode_bad_words(args.bad_words, tokenizer, name="--bad-words"))


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", choices=SCHEDULER_CHOICES, default="off",
                        help="how many drafts to verify per round: off = all, threshold / sps = by the confidence "
                             "head, per request; cost = across the batch, by the paper's Algorithm 1 with "
                             "--cost-table (batched engine only)")
    parser.add_argument("--threshold", type=float, default=0.0,
                        help="in [0, 1]; threshold scheduler: minimum prefix survival; sps: survival floor")
    parser.add_argument("--cost-table", metavar="FILE", default=None,
                        help="cost scheduler: the verify cost table JSON that dspark profile writes")
    parser.add_argument("--min-predicted-gain", type=float, default=0.04,
                        help="cost scheduler: trim verification only when the predicted goodput beats the full "
                             "block by this fraction")
    add_schedule_signal_argument(parser)
    add_tree_arguments(parser)
    add_draft_candidate_arguments(parser)


def add_draft_candidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-candidates", type=int, default=DEFAULT_DRAFT_CANDIDATES,
                        help="sampled requests draft over each position's top-C drafter logits (exact: verified "
                             "against the distribution they came from); 0: over the whole vocabulary")
    parser.add_argument("--draft-successors", type=int, default=DEFAULT_DRAFT_SUCCESSORS,
                        help="with --draft-candidates C > 0: also the previous token's M likeliest successors under "
                             "the drafter's Markov head")


def add_schedule_signal_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule-signal", choices=SCHEDULE_SIGNALS, default="confidence",
                        help="what the threshold / sps / cost schedulers read as each draft's acceptance: the "
                             "drafter's confidence head, or online: the acceptances observed so far, per request")


def add_eager_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly: no CUDA graphs (default on a GPU: every graph captured at "
                             "start-up, so no request waits for a capture)")


def add_parallel_argument(parser: argparse.ArgumentParser, more: str = "") -> None:
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the target over N GPUs (one process each, rank r on cuda:r; Llama / Qwen2 / "
                             "Qwen3 targets), the draft replicated on each" + more)


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share the KV blocks of prompts that start alike between requests (full blocks of "
                             "committed tokens, target and draft K/V)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the GPU's memory the engine may fill, weights and other processes "
                             "included: the rest of it after a step's working memory holds KV blocks")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks to allocate, overriding --gpu-memory-utilization (default on a CPU: "
                             "enough for --max-batch requests of --max-model-len)")
    parser.add_argument("--kv-block-size", type=int, default=16, help="positions per KV block")


def kv_cache_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` / ``LLM`` fields of ``add_kv_cache_arguments``."""
    return dict(enable_prefix_caching=args.enable_prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
                num_kv_blocks=args.num_kv_blocks, kv_block_size=args.kv_block_size)


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-top-k", type=int, default=1,
                        help="candidates per depth; > 1: tree mode (DDTree: a token tree verified per round, greedy or "
                             "sampled, batched engine), 1: the chain")
    parser.add_argument("--tree-budget", type=int, default=0,
                        help="tree mode: nodes verified per round, the root included (2..64; 0: block size + 1); "
                             "--threshold with --scheduler threshold / sps is the survival floor of its depth")


def sampling_params(args: argparse.Namespace, command: str):
    """``SamplingParams`` of the sampling options; warns (stderr) about filters greedy decoding ignores."""
    from dspark.engine import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.min_p,
                              parse_logit_bias(args.logit_bias))
    if sampling.greedy and args.temperature < 1e-3 and (args.top_k > 1 or args.top_p != 1.0 or args.min_p > 0):
        print(f"dspark {command}: warning: --top-k / --top-p / --min-p do nothing with greedy decoding "
              f"(--temperature 0)", file=sys.stderr)
    return sampling


def parse_logit_bias(entries: list[str]) -> dict[int, float]:
    """``--logit-bias ID=BIAS`` entries as a dict; ValueError naming an entry that is not one."""
    bias = {}
    for entry in entries:
        token, _, value = entry.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=BIAS (a token id and a number), got {entry!r}") from None
    return bias


def check_draft_candidate_arguments(args: argparse.Namespace) -> None:
    """ValueError for a negative ``--draft-candidates`` or ``--draft-successors``."""
    if args.draft_candidates < 0:
        raise ValueError(f"--draft-candidates must be >= 0 (0 = the whole vocabulary), got {args.draft_candidates}")
    if args.draft_successors < 0:
        raise ValueError(f"--draft-successors must be >= 0, got {args.draft_successors}")


def check_scheduler_arguments(args: argparse.Namespace) -> None:
    """ValueError for a ``--threshold`` out of [0, 1] or given while the scheduler is off or cost,
    ``--scheduler cost`` without ``--cost-table``, and a ``--cost-table`` nothing reads."""
    if not 0.0 <= args.threshold <= 1.0:
        raise ValueError(f"--threshold must be in [0, 1] (a survival probability), got {args.threshold}")
    check_draft_candidate_arguments(args)
    if args.draft_top_k == 1 and args.tree_budget:
        raise ValueError(f"--tree-budget {args.tree_budget} needs tree mode: add --draft-top-k K (2..8)")
    if args.schedule_signal == "online" and (args.scheduler == "off" or args.draft_top_k > 1):
        raise ValueError("--schedule-signal online needs --scheduler threshold, sps or cost on chains "
                         f"(--draft-top-k 1), got --scheduler {args.scheduler} --draft-top-k {args.draft_top_k}")
    if args.scheduler in ("off", "cost") and args.threshold != 0.0:
        raise ValueError(f"--threshold {args.threshold} does nothing with --scheduler {args.scheduler}: "
                         f"add --scheduler threshold or --scheduler sps")
    if args.scheduler != "cost":
        if args.cost_table is not None:
            raise ValueError(f"--cost-table {args.cost_table} is read only by --scheduler cost, "
                             f"got --scheduler {args.scheduler}")
        return
    if args.cost_table is None:
        raise ValueError("--scheduler cost needs --cost-table FILE: the cost table JSON that `dspark profile` "
                         "writes for this target and device")
    if not Path(args.cost_table).is_file():
        raise ValueError(f"--cost-table {args.cost_table} not found (write it with dspark profile --out FILE)")


# ---- stop strings -----------------------------------------------------------------------------------

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
_HEX_DIGITS = {"x": 2, "u": 4}


def process_escapes(text: str) -> str:
    """``text`` with the escapes of llama.cpp's ``--stop`` / ``-p`` processed: ``\\n``, ``\\t``,
    ``\\r``, ``\\\\``, ``\\"``, ``\\'``, ``\\xHH`` and ``\\uXXXX`` (a shell passes ``"\\n"``
    as a backslash and an n, so ``--stop "\\n\\n"`` would otherwise never match); any other backslash
    stays as it is, as in llama.cpp. ValueError for ``\\x`` / ``\\u`` without their hex digits."""
    out, i = [], 0
    while i < len(text):
        char, code = text[i], text[i + 1:i + 2]
        if char != "\\" or not code:
            out.append(char)
            i += 1
        elif code in _ESCAPES:
            out.append(_ESCAPES[code])
            i += 2
        elif code in _HEX_DIGITS:
            width = _HEX_DIGITS[code]
            digits = text[i + 2:i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise ValueError(f"\\{code} must be followed by {width} hex digits, got {text[i:i + 2 + width]!r} "
                                 f"in {text!r}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        else:
            out.append(char + code)
            i += 2
    return "".join(out)


def stop_string(text: str) -> str:
    """argparse ``type`` of ``--stop``: the escapes processed (``process_escapes``); an empty stop
    string would end every output at once, so it is refused."""
    try:
        stop = process_escapes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not stop:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return stop


def progress_bar(args: argparse.Namespace, name: str):
    """A ``Progress`` bar on stderr, or None with ``--quiet``."""
    from dspark.training.trainer import Progress

    return None if args.quiet else Progress(name)


REDUCED_PRECISION_NOTE = (
    "in {dtype} a verify forward over several tokens and a one-token decode step round differently, so "
    "a near-tie between the two best tokens can go either way and greedy outputs may part there; "
    "run with --dtype float32 to check exactness")


def mismatch_status(dtype, where: str, command: str) -> int:
    """Exit status for greedy outputs that differ from plain decoding: 1 (an error) in float32/float64,
    where the engine must reproduce plain greedy decoding token for token; in reduced precision the
    difference is rounding, so a note on stderr and 0."""
    import torch

    if dtype in (torch.float32, torch.float64):
        print(f"dspark {command}: greedy outputs differ from plain decoding for {where}", file=sys.stderr)
        return 1
    note = REDUCED_PRECISION_NOTE.format(dtype=str(dtype).replace("torch.", ""))
    print(f"dspark {command}: greedy outputs differ from plain decoding for {where}: {note}", file=sys.stderr)
    return 0
