"""Local text corpora: finding files, training a tokenizer, encoding, cutting batches and prompts.

Pure functions of their inputs (file contents, seeds); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2; "</s>" also separates files
TEST_DIRS = frozenset({"test", "tests", "idle_test", "testing"})
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "lib-dynload"})


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder (its ``.py`` sources are the demo corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(paths: Iterable[str | Path], suffixes: Sequence[str] = (".py",), tests: bool = False) -> list[Path]:
    """Files under ``paths`` (files are taken as given; folders are walked for ``suffixes``),
    sorted, so the same paths give the same corpus. ``tests``: walk only test folders
    (``test``/``tests``/...) instead of leaving them out."""
    out: dict[Path, Path] = {}  # by the file's real path: one reached through two links is read once
    for p in map(Path, paths):
        if p.is_file():
            out.setdefault(p.resolve(), p)
            continue
        if not p.is_dir():
            raise FileNotFoundError(f"corpus path {p} does not exist")
        walked: set[Path] = set()  # real folders: a link back up the tree is walked once, not forever
        for root, dirs, files in os.walk(p, followlinks=True):  # corpora are often folders of links
            real = Path(root).resolve()
            if real in walked:
                dirs[:] = []
                continue
            walked.add(real)
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith((".", "config-")))
            in_tests = any(part in TEST_DIRS for part in Path(root).relative_to(p).parts)
            if not tests:
                dirs[:] = [d for d in dirs if d not in TEST_DIRS]
            for name in files:
                f = Path(root) / name
                if name.endswith(tuple(suffixes)) and (in_tests or not tests) and f.is_file():
                    out.setdefault(f.resolve(), f)
    return sorted(out.values())


def read_texts(files: Sequence[Path], max_bytes: int = 0) -> list[str]:
    """Each file's text (undecodable bytes replaced); ``max_bytes`` > 0 stops once that much is read."""
    texts, total = [], 0
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        texts.append(text)
        total += len(text)
        if max_bytes and total >= max_bytes:
            break
    return texts


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with ``<s>``, ``</s>``, ``<unk>`` as ids 0, 1, 2 (text in, text out)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_sentencepiece_style_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A SentencePiece-style BPE as Llama 2, Mistral and Gemma ship it: ``▁`` stands for a space, and a
    character the merges do not cover is written as its UTF-8 bytes, ``<0xNN>`` tokens in the vocabulary
    (byte fallback); ``<s>``, ``</s>``, ``<unk>`` are ids 0, 1, 2. ``vocab_size`` counts the 256 byte tokens.
    A tokenizer unlike :func:`train_tokenizer`'s, for drafts with another tokenizer (docs/models.md)."""
    steps = {
        "normalizer": normalizers.Replace(" ", "▁"),
        "pre_tokenizer": pre_tokenizers.Split("▁", behavior="merged_with_next"),
        "decoder": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
    }
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    for name, step in steps.items():
        setattr(trained, name, step)
    trainer = trainers.BpeTrainer(
        vocab_size=max(len(SPECIAL_TOKENS) + 1, vocab_size - 256),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    trained.train_from_iterator(texts, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):  # byte fallback: every byte has a token
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    for name, step in steps.items():
        setattr(tok, name, step)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def encode(tokenizer: Tokenizer, texts: Sequence[str], eos_token_id: int) -> torch.Tensor:
    """All texts as one stream of token IDs with EOS after each.  # [num_tokens] int64"""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def split_stream(stream: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation parts: the last ``val_fraction`` of the stream is held out."""
    cut = len(stream) - int(len(stream) * val_fraction)
    return stream[:cut], stream[cut:]


def random_windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` windows of ``length`` tokens at random offsets.  # [count, length]"""
    if len(stream) <= length:
        raise ValueError(f"the corpus has {len(stream)} tokens, fewer than one window of {length}")
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one training step: batches depend on (seed, step) only, so a resumed
    run draws exactly the batches the uninterrupted run would have."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def code_prompts(texts: Sequence[str], count: int, seed: int, min_lines: int = 6, max_lines: int = 16) -> list[str]:
    """``count`` fragments of ``min_lines``-``max_lines`` whole lines cut from ``texts`` at random
    (non-blank start), for held-out prompt sets."""
    g = torch.Generator().manual_seed(seed)
    docs = [t.splitlines(keepends=True) for t in texts if len(t.splitlines()) > max_lines]
    if not docs:
        raise ValueError(f"no text has more than {max_lines} lines to cut prompts from")
    prompts: list[str] = []
    tries = 0
    while len(prompts) < count and tries < count * 50:
        tries += 1
        lines = docs[int(torch.randint(len(docs), (1,), generator=g))]
        n = int(torch.randint(min_lines, max_lines + 1, (1,), generator=g))
        start = int(torch.randint(0, len(lines) - n, (1,), generator=g))
        chunk = lines[start : start + n]
        if not chunk[0].strip() or sum(bool(x.strip()) for x in chunk) < min_lines // 2:
            continue
        prompts.append("".join(chunk))
    return prompts
