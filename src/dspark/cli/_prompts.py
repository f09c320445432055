"""``--prompt-file``: a text file (one prompt; ``-`` reads stdin) or a JSON Lines file of requests.

A ``.jsonl`` line is an object with ``prompt`` (text) or ``prompt_ids`` (a list of token ids) and
optionally ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``logit_bias`` (an
object of token ids, as strings, to numbers: OpenAI's), ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``min_tokens``, ``bad_words`` (a list of strings) and ``seed``, which
override the command's options for that request. Blank lines are skipped; every error names the file and line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OVERRIDES = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float,
             "logit_bias": dict, "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
             "min_tokens": int, "bad_words": list, "seed": int}


def read_prompt_file(path: str) -> list[tuple[str, dict]]:
    """``(where, record)`` per request: ``where`` names the source for error messages (``FILE`` or
    ``FILE:LINE``); ``record`` holds ``prompt`` or ``prompt_ids`` and any overrides, type-checked.
    ValueError naming the file (and line) for a missing file, text that is not UTF-8, invalid JSON
    or a malformed request."""
    if path == "-":
        data, name = sys.stdin.buffer.read(), "<stdin>"
    else:
        file = Path(path)
        if not file.exists():
            raise ValueError(f"--prompt-file {path} not found")
        if not file.is_file():
            raise ValueError(f"--prompt-file {path} is not a file")
        data, name = file.read_bytes(), path
    if name.endswith(".jsonl"):
        records = [(f"{name}:{n}", _request(f"{name}:{n}", _utf8(name, line, n)))
                   for n, line in enumerate(data.split(b"\n"), start=1) if line.strip()]
        if not records:
            raise ValueError(f"{name} holds no request")
        return records
    text = _utf8(name, data, 1)
    if not text.strip():
        raise ValueError(f"{name} holds no prompt: it is empty")
    return [(name, {"prompt": text})]


def _utf8(name: str, data: bytes, first_line: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + data[:exc.start].count(b"\n")
        raise ValueError(f"{name}:{line} is not UTF-8 text (byte {data[exc.start]:#04x})") from None


def _request(where: str, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a request must be a JSON object, got {type(record).__name__}")
    if ("prompt" in record) == ("prompt_ids" in record):
        raise ValueError(f"{where}: a request needs exactly one of 'prompt' (text) and 'prompt_ids' (token ids)")
    unknown = sorted(set(record) - {"prompt", "prompt_ids", *OVERRIDES})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a request may hold prompt or prompt_ids and "
                         f"{', '.join(OVERRIDES)}")
    if "prompt" in record and not isinstance(record["prompt"], str):
        raise ValueError(f"{where}: 'prompt' must be a string, got {type(record['prompt']).__name__}")
    ids = record.get("prompt_ids", [0])
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ValueError(f"{where}: 'prompt_ids' must be a list of token ids (integers), got {ids!r}"[:300])
    for key, kind in OVERRIDES.items():
        value = record.get(key)
        if kind in (dict, list) or key not in record:  # checked where they are read
            continue
        if type(value) is not int and not (kind is float and type(value) is float):
            raise ValueError(f"{where}: '{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if "logit_bias" in record:
        record["logit_bias"] = _logit_bias(where, record["logit_bias"])
    return record


def _logit_bias(where: str, bias) -> dict[int, float]:
    """OpenAI's ``logit_bias`` object (token ids as decimal strings -> numbers) with int ids; the
    ranges are ``SamplingParams``' to check."""
    entries = bias.items() if isinstance(bias, dict) else ()
    if not isinstance(bias, dict) or not all(k.isascii() and k.isdigit() and type(v) in (int, float)
                                             for k, v in entries):
        raise ValueError(f"{where}: 'logit_bias' must be an object of token ids (decimal strings) to numbers, "
                         f"got {bias!r}"[:300])
    return {int(k): v for k, v in bias.items()}
