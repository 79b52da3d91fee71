"""GGUF checkpoints (llama.cpp's and Ollama's one-file format) as Hugging Face checkpoint folders.

A *GGUF file* holds a model's architecture, configuration, tokenizer (with its chat template) and weights,
often quantized (Q8_0, Q4_0, Q4_1, K-quants). :func:`gguf_folder` reads one through transformers' GGUF reader
(it maps the llama.cpp architecture and tensor names onto transformers' and dequantizes the weights), and
writes what it read as a checkpoint folder: ``config.json``, ``model.safetensors`` in float32 (the exact values
the quantized weights stand for: every run dtype is a rounding of them), ``tokenizer.json`` and
``tokenizer_config.json`` (the chat template). Every runtime then reads the folder as any other. The folder is
cached by the file's path, size and modification time (:func:`cache_dir`), written to a temporary folder and
renamed into place, so processes converting the same file at once (``specinfer up``'s members) never see half
of one.

The weights are dequantized, not kept quantized: the model runs at the dtype the runtime picks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from specinfer.core import InvalidArgument

GGUF_SUFFIX = ".gguf"
FORMAT = 2  # of the converted folders: a change of what is written makes new cache entries (2: architectures)


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; a folder is never one)."""
    return str(path).lower().endswith(GGUF_SUFFIX) and not Path(path).is_dir()


def cache_dir(environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """Where converted GGUF files are kept: ``$SPECINFER_GGUF_CACHE``, else ``$XDG_CACHE_HOME/specinfer/gguf``,
    else ``~/.cache/specinfer/gguf``."""
    if environ.get("SPECINFER_GGUF_CACHE"):
        return Path(environ["SPECINFER_GGUF_CACHE"])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specinfer/gguf"


def gguf_folder(path: str | os.PathLike, field: str, cache: Path | None = None) -> Path:
    """The checkpoint folder of GGUF file ``path`` (converted once, then cached); ``field``: the setting that
    named it, which errors name (InvalidArgument: a missing file, a file transformers cannot map)."""
    source = Path(path).resolve()
    if not source.is_file():
        raise InvalidArgument(field, f"{str(path)!r} is not a GGUF file (no such file)")
    stat = source.stat()
    key = hashlib.sha256(f"{FORMAT}:{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = (cache or cache_dir()) / f"{source.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _convert(source, work, field)
        try:
            work.rename(folder)
        except OSError:  # another process converted it meanwhile: keep theirs
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def _convert(source: Path, out: Path, field: str) -> None:
    """Read ``source`` with transformers' GGUF reader and write it into the folder ``out``."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - torch and transformers are dependencies
        raise InvalidArgument(field, f"reading a GGUF file needs {exc.name}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except ImportError as exc:
        raise InvalidArgument(
            field, f"reading a GGUF file needs the gguf and accelerate packages ({exc}): pip install 'specinfer[gguf]'"
        ) from None
    except (ValueError, KeyError, NotImplementedError) as exc:  # an architecture or tensor type it cannot map
        raise InvalidArgument(field, f"{source}: cannot be read as a Hugging Face model: {exc}") from None
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one tensor on disk, as transformers saves tied weights
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain float32
    config["torch_dtype"] = "float32"
    # transformers' reader leaves it None; tools that read a checkpoint folder by its class (llama.cpp's converter,
    # transformers' pipelines) need it
    config["architectures"] = [type(model).__name__]
    config["specinfer_source"] = {"gguf": str(source), "format": FORMAT}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out)
    if not (out / "tokenizer.json").is_file():
        raise InvalidArgument(field, f"{source}: its tokenizer has no fast (tokenizer.json) form")
