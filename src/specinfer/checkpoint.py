"""Facts read from a Hugging Face checkpoint folder without loading weights (no torch), so the
request manager can use them too."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from specinfer.core.errors import InvalidArgument
from specinfer.core.vocab_map import TokenTable


def model_folder(path: str | Path, field: str) -> Path:
    """The checkpoint folder ``path`` names: the folder itself, or for a GGUF file (``*.gguf``) the folder it is
    converted into once (:mod:`specinfer.models.gguf`, cached). The commands convert at their entry, so that
    everything after them reads folders."""
    from specinfer.models.gguf import gguf_folder, is_gguf

    return gguf_folder(path, field) if is_gguf(path) else Path(path)


def check_checkpoint(path: str | Path, field: str) -> Path:
    """A folder whose ``config.json`` is a JSON object; raises :class:`InvalidArgument` naming ``field`` (the
    setting that names the folder) when it is missing, not a folder, or its config.json is missing or unreadable."""
    p = Path(path)
    config = p / "config.json"
    if not p.is_dir():
        raise InvalidArgument(field, f"{str(p)!r} is not a Hugging Face checkpoint folder (no such folder)")
    if not config.is_file():
        raise InvalidArgument(field, f"{str(p)!r} is not a Hugging Face checkpoint folder (no config.json)")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(field, f"{str(config)!r} cannot be read: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument(field, f"{str(config)!r} is not a JSON object")
    return p


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it ships none."""
    f = Path(path) / "tokenizer.json"
    return Tokenizer.from_file(str(f)) if f.is_file() else None


def eos_token_id(path: str | Path) -> int | None:
    """EOS from generation_config.json, else config.json (the first one if a list)."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None


def vocab_size(path: str | Path) -> int | None:
    """The model's vocabulary (embedding rows) from config.json (a multimodal config's ``text_config``)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    size = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


def token_table(path: str | Path) -> TokenTable | None:
    """Every token's spelling (:class:`specinfer.core.vocab_map.TokenTable`) from the checkpoint's
    tokenizer, for ``vocab_size`` rows; None when it ships no tokenizer.json."""
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        return None
    size = vocab_size(path) or tokenizer.get_vocab_size(with_added_tokens=True)
    return tokenizer_table(tokenizer, size, eos_token_id(path))


def tokenizer_table(tokenizer: Tokenizer, size: int, eos: int | None) -> TokenTable:
    """The spellings of token IDs ``0 .. size-1`` as ``tokenizer`` decodes them.

    Byte-level BPE (GPT-2, Llama 3, Qwen) writes each byte as one printable character; SentencePiece-style
    tokenizers (Llama 2, Gemma, Mistral) write a space as ``▁`` and an unknown byte as ``<0xNN>``
    (byte fallback); anything else is taken as its UTF-8 text. Special added tokens get no spelling.
    """
    spec = json.loads(tokenizer.to_str())
    kinds = _component_types(spec.get("decoder")) | _component_types(spec.get("pre_tokenizer"))
    added = tokenizer.get_added_tokens_decoder()
    special = {i: tok.content for i, tok in added.items() if tok.special and i < size}
    if "ByteLevel" in kinds:
        table = _byte_level_chars()
        spell = lambda s: bytes(table[c] for c in s) if all(c in table for c in s) else s.encode()  # noqa: E731
    else:
        metaspace = "Metaspace" in kinds or "▁" in json.dumps(spec.get("decoder"), ensure_ascii=False)
        spell = lambda s: _byte_fallback(s) or (s.replace("▁", " ") if metaspace else s).encode()  # noqa: E731
    spellings: list[bytes | None] = []
    for i in range(size):
        token = tokenizer.id_to_token(i)
        if token is None or i in special:
            spellings.append(None)
        elif i in added:  # a normal added token stands for its content as written
            spellings.append(added[i].content.encode())
        else:
            spellings.append(spell(token))
    return TokenTable(tuple(spellings), special, eos)


def _component_types(component: dict | None) -> set[str]:
    """The ``type`` of a tokenizer.json component and of the parts of a ``Sequence`` component."""
    if not component:
        return set()
    out = {str(component.get("type"))}
    for part in component.get("decoders", []) + component.get("pretokenizers", []):
        out |= _component_types(part)
    return out


def _byte_fallback(token: str) -> bytes | None:
    """``<0xNN>`` (SentencePiece byte fallback) as its byte."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            return None
    return None


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
