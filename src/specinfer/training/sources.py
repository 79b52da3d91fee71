"""What training starts from: a Llama of a given shape or a checkpoint, and a corpus as token
streams (terms as in :mod:`specinfer.training`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from specinfer.core import InvalidArgument


@dataclass(frozen=True)
class ArchSpec:
    """A Llama shape: ``layers=1,hidden=128,heads=2,intermediate=352`` on the command line."""

    layers: int
    hidden: int
    heads: int
    intermediate: int

    @staticmethod
    def parse(text: str, field: str = "config") -> ArchSpec:
        try:
            kv = dict(part.split("=", 1) for part in text.split(",") if part.strip())
            spec = ArchSpec(**{k.strip(): int(v) for k, v in kv.items()})
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                field, f"expected layers=L,hidden=H,heads=N,intermediate=I, got {text!r} ({exc})"
            ) from None
        if min(asdict(spec).values()) <= 0 or spec.hidden % spec.heads:
            raise InvalidArgument(field, f"{text!r}: every value > 0 and hidden divisible by heads")
        return spec


def new_llama(spec: ArchSpec, vocab_size: int, max_positions: int, seed: int, bos: int = 0, eos: int = 1):
    """A freshly initialised Llama with tied input/output embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=max_positions,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_model(path: Path):
    """A checkpoint in float32 for training or measuring."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def student_from(init: Path | None, config: str, llm) -> object:
    """The SSM to train: a copy of ``init``, or a new Llama of shape ``config`` sharing the LLM's
    vocabulary and special tokens."""
    if init is not None:
        from specinfer.models.loading import check_checkpoint

        check_checkpoint(init, "init")
        model = load_model(init)
        if model.config.vocab_size != llm.config.vocab_size:
            raise InvalidArgument(
                "init", f"vocabulary {model.config.vocab_size} differs from the LLM's {llm.config.vocab_size}"
            )
        return model
    spec = ArchSpec.parse(config)
    c = llm.config
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    return new_llama(
        spec,
        c.vocab_size,
        c.max_position_embeddings,
        seed=0,
        bos=c.bos_token_id or 0,
        eos=eos if eos is not None else 1,
    )


def corpus_tokens(tokenizer_dir: Path, corpus: tuple[Path, ...], max_bytes: int, val_fraction: float, log):
    """The corpus as (training, validation) token streams in the tokenizer of ``tokenizer_dir``."""
    from specinfer.checkpoint import eos_token_id, load_tokenizer
    from specinfer.training.corpus import encode, read_texts, source_files, split_stream

    tok = load_tokenizer(tokenizer_dir)
    if tok is None:
        raise InvalidArgument("llm", f"{tokenizer_dir} has no tokenizer.json to encode the corpus with")
    try:
        files = source_files(corpus)
    except FileNotFoundError as exc:
        raise InvalidArgument("corpus", str(exc)) from None
    texts = read_texts(files, max_bytes)
    if not texts:
        raise InvalidArgument("corpus", "no text found")
    eos = eos_token_id(tokenizer_dir)
    stream = encode(tok, texts, 1 if eos is None else eos)
    print(
        f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f} MB, {len(stream)} tokens", file=log, flush=True
    )
    return split_stream(stream, val_fraction)


def window_batches(stream, batch_size: int, seq_len: int, seed: int):
    """Batch source of random corpus windows (next-token targets everywhere)."""
    import torch

    from specinfer.training.corpus import random_windows, step_generator

    def source(step: int):
        w = random_windows(stream, batch_size, seq_len + 1, step_generator(seed, step))  # [B, T + 1]
        return w[:, :-1], w[:, 1:], torch.ones(batch_size, seq_len, dtype=torch.bool)

    return source


def val_windows(stream, seq_len: int, count: int = 16, seed: int = 12345):
    import torch

    from specinfer.training.corpus import random_windows

    if len(stream) <= seq_len + 1:
        return []
    w = random_windows(stream, count, seq_len + 1, torch.Generator().manual_seed(seed))
    return [
        (w[i : i + 8, :-1], w[i : i + 8, 1:], torch.ones(len(w[i : i + 8]), seq_len, dtype=torch.bool))
        for i in range(0, count, 8)
    ]


@dataclass(frozen=True)
class StudentSource:
    """What an SSM is trained from: the teacher ``llm`` (its tokenizer encodes the corpus), the
    starting point (the checkpoint ``init`` or a new Llama of shape ``config``: exactly one), and
    the ``corpus`` (at most ``max_corpus_bytes`` of it read; 0: all)."""

    llm: Path
    corpus: tuple[Path, ...]
    init: Path | None = None
    config: str = ""
    max_corpus_bytes: int = 0

    def validate(self) -> None:
        if (self.init is None) == (not self.config):
            raise InvalidArgument("init", "give exactly one of --init DIR and --config SHAPE")

    def teacher(self):
        """The LLM as a float32 model."""
        from specinfer.models.loading import check_checkpoint

        check_checkpoint(self.llm, "llm")
        return load_model(self.llm)

    def student(self, llm):
        """A fresh copy of the starting point (every call loads or builds it anew)."""
        return student_from(self.init, self.config, llm)

    def tokens(self, val_fraction: float, log):
        return corpus_tokens(self.llm, self.corpus, self.max_corpus_bytes, val_fraction, log)
