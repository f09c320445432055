"""Training and evaluation data: corpora, the standard-library corpus, tokenizers, packing, prompts.

A corpus is named by a *spec* string:

* ``stdlib:train`` / ``stdlib:valid`` / ``stdlib:test`` -- the ``.py`` files of this Python's
  standard library (``site-packages`` excluded), split deterministically by a CRC-32 of each file's
  path relative to the library root, so the same file lands in the same split on every machine and
  Python version: 4 % ``test`` (held out for evaluation and the demo prompts), 4 % ``valid``
  (held out for calibration), the rest ``train``;
* ``python:train`` / ``python:valid`` -- all the Python source this interpreter has: the standard
  library's files of that split and every installed package's ``.py`` file (below ``site-packages`` /
  ``dist-packages``), split the same way by the path below that directory, their ``test`` share
  joining ``train``; a package file whose text equals a held-out ``stdlib:test`` file's is left out;
* a text file, a directory (every UTF-8 file below it, sorted; hidden entries skipped), or a
  ``.jsonl`` file whose records hold ``"text"`` (a string) or ``"turns"`` (a list of strings, joined
  by blank lines; the format of ``../shared/data/eval``).

Prompt files (``read_prompts``) are JSON Lines too: ``"text"`` records are raw prompts, ``"turns"``
records are chat prompts (the first turn, through the tokenizer's chat template when it has one).
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels._validate import Checker

__all__ = [
    "STDLIB_SPLITS", "EOS_TOKEN", "MASK_TOKEN", "DEMO_DIR", "DemoPair",
    "stdlib_root", "stdlib_split", "stdlib_files", "read_corpus", "train_tokenizer", "save_tokenizer", "tokenize",
    "python_files", "pack_sequences", "heldout_prompts", "write_prompts", "read_prompts", "prompt_token_ids", "demo_pair",
]

STDLIB_SPLITS = ("train", "valid", "test")
_SPLIT_BUCKETS = 50  # crc32 % 50: 0-1 test, 2-3 valid, 4-49 train
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"  # the draft block's mask token (speculators' name for an added mask token)
DEMO_DIR = Path(__file__).resolve().parent.parent / "data" / "demo"


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library (``sysconfig`` ``stdlib`` path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_split(relative_path: str) -> str:
    """``"train"``, ``"valid"`` or ``"test"`` for a path relative to the library root (POSIX form)."""
    bucket = zlib.crc32(relative_path.encode("utf-8")) % _SPLIT_BUCKETS
    return "test" if bucket < 2 else "valid" if bucket < 4 else "train"


def stdlib_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library in ``split`` (``site-packages`` and
    ``dist-packages`` excluded: installed packages are not the standard library)."""
    c = Checker("stdlib_files")
    if split not in STDLIB_SPLITS:
        c.fail(f"split must be one of {list(STDLIB_SPLITS)}, got {split!r}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        c.fail(f"standard library directory {str(root)!r} does not exist")
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages"} & set(rel.parts) or not path.is_file():
            continue
        if stdlib_split(rel.as_posix()) == split:
            files.append(path)
    return files


def _package_roots() -> list[Path]:
    """The installed packages' directories of this interpreter (``site-packages`` / ``dist-packages``)."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths[k]) for k in ("purelib", "platlib") if Path(paths[k]).is_dir()})


def python_files(split: str, stdlib: Path | None = None, packages: list[Path] | None = None) -> list[Path]:
    """Sorted ``.py`` files of the ``python:`` corpus in ``split`` (``"train"`` or ``"valid"``; the
    module docstring): the standard library's and the installed packages'."""
    c = Checker("python_files")
    if split not in ("train", "valid"):
        c.fail(f"split must be 'train' or 'valid' (the held-out files are stdlib:test), got {split!r}")
    heldout = {(p.stat().st_size, zlib.crc32(p.read_bytes())) for p in stdlib_files("test", stdlib)}
    sizes = {size for size, _ in heldout}

    def copy_of_heldout(path: Path) -> bool:  # read only the files as large as a held-out one
        size = path.stat().st_size
        return size in sizes and (size, zlib.crc32(path.read_bytes())) in heldout

    files = stdlib_files(split, stdlib)
    for root in _package_roots() if packages is None else packages:
        for path in sorted(Path(root).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and (stdlib_split(rel) == "valid") == (split == "valid") and not copy_of_heldout(path):
                files.append(path)
    return files


def read_corpus(spec: str) -> list[str]:
    """The documents (one string each) of a corpus spec (see the module docstring). Empty
    documents are dropped; a spec that yields no document raises ValueError."""
    c = Checker("read_corpus")
    if not isinstance(spec, (str, Path)):
        c.fail(f"spec must be a corpus name or path, got {type(spec).__name__}", TypeError)
    spec = str(spec)
    if spec.startswith(("stdlib:", "python:")):
        kind, split = spec.split(":", 1)
        texts = [_read_text(p) for p in (stdlib_files if kind == "stdlib" else python_files)(split)]
    else:
        path = Path(spec)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            texts = [_read_text(p) for p in files]
        elif path.suffix == ".jsonl" and path.is_file():
            texts = [_record_text(c, record, f"{path}:{i + 1}") for i, record in enumerate(_jsonl(c, path))]
        elif path.is_file():
            texts = [_read_text(path)]
        else:
            c.fail(f"spec must be stdlib:train|valid|test, python:train|valid, a file, a directory or a .jsonl file; "
                   f"{spec!r} is none of these")
    texts = [t for t in texts if t]
    if not texts:
        c.fail(f"corpus {spec!r} holds no text")
    return texts


def _read_text(path: Path) -> str | None:
    """File contents, or None for a file that is not UTF-8 text (binary files are skipped)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def _jsonl(c: Checker, path: Path) -> list[dict]:
    records = []
    for i, line in enumerate(path.read_bytes().split(b"\n")):
        if line.strip():
            try:
                records.append(json.loads(line.decode("utf-8")))
            except UnicodeDecodeError:
                c.fail(f"{path}:{i + 1} is not UTF-8 text")
            except json.JSONDecodeError as exc:
                c.fail(f"{path}:{i + 1} is not valid JSON ({exc.msg})")
    return records


def _record_text(c: Checker, record, where: str) -> str:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    if isinstance(record, dict) and isinstance(record.get("turns"), list) and all(
            isinstance(t, str) for t in record["turns"]):
        return "\n\n".join(record["turns"])
    c.fail(f"{where}: a record must hold 'text' (a string) or 'turns' (a list of strings), got "
           f"{sorted(record) if isinstance(record, dict) else type(record).__name__}")


# ---- tokenizers and packing ---------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` with the ``tokenizers`` library, wrapped as a
    transformers fast tokenizer (``save_pretrained`` writes ``tokenizer.json``; ``AutoTokenizer``
    loads it). Special tokens: ``<|endoftext|>`` (id 0; document separator, EOS and padding) and
    ``<|MASK|>`` (id 1; the draft block's mask token). Byte-level, so every text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    c = Checker("train_tokenizer")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    c.integer("vocab_size", vocab_size, low=len(alphabet) + 2)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   mask_token=MASK_TOKEN)


# a plain role-tagged chat format for a target trained from scratch (the server's /v1/chat/completions)
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + (message['content'] or '') + "
                 "'\\n' }}{%- if message['role'] == 'assistant' %}{{- eos_token }}{%- endif %}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}")


def save_tokenizer(tokenizer, directory) -> Path:
    """``save_pretrained`` with ``tokenizer_class`` "PreTrainedTokenizerFast" (the name every
    transformers version resolves; 5.x writes its new "TokenizersBackend", unknown to 4.x) and, when
    the tokenizer has none, the role-tagged ``CHAT_TEMPLATE``."""
    directory = Path(directory)
    tokenizer.save_pretrained(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("chat_template", CHAT_TEMPLATE)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return directory


def tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (no special tokens added)."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack_sequences(token_lists: list[list[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Documents joined into one stream, each followed by ``eos_id``, cut into rows of ``seq_len``:
    int64 ``[N, seq_len]`` (the tail shorter than a row is dropped; GPT-style packing, so a row may
    span a document boundary, which the EOS marks)."""
    c = Checker("pack_sequences")
    c.integer("seq_len", seq_len, low=2)
    # one tensor per document, then one concatenation: a corpus of 10^8 tokens never becomes one Python list
    stream = torch.cat([torch.tensor([*ids, eos_id], dtype=torch.int64) for ids in token_lists] or
                       [torch.zeros(0, dtype=torch.int64)])
    rows = stream.numel() // seq_len
    if rows == 0:
        c.fail(f"the corpus has {stream.numel()} tokens, fewer than one row of seq_len={seq_len}")
    return stream[: rows * seq_len].view(rows, seq_len)


# ---- prompts ------------------------------------------------------------------------------------


def heldout_prompts(split: str = "test", *, max_chars: int = 600, min_chars: int = 200,
                    root: Path | None = None) -> list[dict]:
    """The start of each standard-library file of ``split``: records ``{"file", "text"}``, the text
    cut at the last line break within ``max_chars`` with the whitespace before it (blank lines too)
    removed; files shorter than ``min_chars`` are skipped. The line breaks are left to the model: the
    byte-level tokenizer joins them with the next line's indentation, and a bare final line break is
    where its training files end (end-of-text)."""
    root = stdlib_root() if root is None else Path(root)
    records = []
    for path in stdlib_files(split, root):
        text = _read_text(path) or ""
        if len(text) < min_chars:
            continue
        head = text[:max_chars]
        cut = head.rfind("\n")
        records.append({"file": path.relative_to(root).as_posix(), "text": (head[:cut] if cut > 0 else head).rstrip()})
    return records


def write_prompts(path, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_prompts(spec: str) -> list[dict]:
    """Prompt records of a JSON Lines file (``"text"`` or ``"turns"`` each) or of a standard-library
    split (``stdlib:test`` -> ``heldout_prompts("test")``)."""
    c = Checker("read_prompts")
    spec = str(spec)
    if spec.startswith("stdlib:"):
        return heldout_prompts(spec.split(":", 1)[1])
    path = Path(spec)
    if not path.exists():
        c.fail(f"prompt file {spec!r} not found (prompts: stdlib:<split> or a .jsonl file)")
    if not path.is_file():
        c.fail(f"prompts must be stdlib:<split> or a .jsonl file, got {spec!r}")
    records = _jsonl(c, path)
    for i, record in enumerate(records):
        _record_text(c, record, f"{path}:{i + 1}")
    if not records:
        c.fail(f"{path} holds no prompt")
    return records


def prompt_token_ids(tokenizer, record: dict) -> list[int]:
    """Token ids of a prompt record: ``"text"`` as is; ``"turns"``: the first turn as a user message
    through the chat template (generation prompt added) when the tokenizer has one, else raw."""
    if "text" in record:
        return tokenize(tokenizer, [record["text"]])[0]
    turn = record["turns"][0]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5.2x
    return tokenize(tokenizer, [turn])[0]


@dataclass(frozen=True)
class DemoPair:
    """The shipped demo pair: ``target`` (Hugging Face directory with its tokenizer), ``draft``
    (speculators DSpark directory), ``prompts`` (held-out prompt records, ``prompts.jsonl``)."""

    target: Path
    draft: Path
    prompts: Path


def demo_pair(directory=DEMO_DIR) -> DemoPair:
    """Locate the demo pair written by ``scripts/build_demo_pair.sh`` (default: the package's
    ``dspark/data/demo``); ValueError naming what is missing."""
    directory = Path(directory)
    pair = DemoPair(directory / "target", directory / "draft", directory / "prompts.jsonl")
    missing = [str(p) for p in (pair.target / "config.json", pair.draft / "config.json", pair.prompts)
               if not p.is_file()]
    if missing:
        Checker("demo_pair").fail(f"the demo pair in {str(directory)!r} is incomplete: missing {missing}; "
                                  f"build it with scripts/build_demo_pair.sh")
    return pair


def main(argv: list[str] | None = None) -> int:
    """``python -m dspark.training.data --split test --output prompts.jsonl``: write held-out prompts."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dspark.training.data", description=main.__doc__)
    parser.add_argument("--split", choices=STDLIB_SPLITS, default="test")
    parser.add_argument("--output", required=True, help="JSON Lines file to write")
    parser.add_argument("--max-chars", type=int, default=600, help="characters of each file's start")
    args = parser.parse_args(argv)
    records = heldout_prompts(args.split, max_chars=args.max_chars)
    write_prompts(args.output, records)
    print(f"wrote {len(records)} prompts from stdlib:{args.split} to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
