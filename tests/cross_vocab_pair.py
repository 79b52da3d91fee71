"""A draft with another tokenizer, made from a draft that shares the LLM's: :func:`relabelled_ssm`.

A tokenizer only has to differ for cross-tokenizer drafting to matter, and a trained draft keeps the
acceptance that makes accepted paths (and the SSM's cache adopting them) happen in the tests. So the
SSM's vocabulary is rebuilt: the LLM's tokens in a shuffled order, some of its multi-byte tokens left
out (the SSM must spell those LLM tokens with several of its own), new tokens the LLM lacks, and the
special tokens at other IDs; the embedding rows follow their tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM


def relabelled_ssm(
    llm_dir: Path,
    ssm_dir: Path,
    out: Path,
    seed: int = 0,
    drop: float = 0.2,
    extra: int = 48,
    max_positions: int | None = None,
) -> Path:
    """``ssm_dir``'s model with another tokenizer (module docstring), saved at ``out``. ``max_positions``:
    a shorter position limit than the SSM's (its RoPE is unchanged, so logits within it are the same)."""
    llm_tok = Tokenizer.from_file(str(llm_dir / "tokenizer.json"))
    cfg = json.loads((ssm_dir / "config.json").read_text())
    size = int(cfg["vocab_size"])
    special = {i: t.content for i, t in llm_tok.get_added_tokens_decoder().items() if t.special}
    rng = random.Random(seed)
    old_ids = [i for i in range(size) if llm_tok.id_to_token(i) is not None]
    dropped = {i for i in old_ids if i not in special and len(llm_tok.id_to_token(i)) > 1 and rng.random() < drop}
    kept = [i for i in old_ids if i not in dropped]
    rng.shuffle(kept)
    strings = [llm_tok.id_to_token(i) for i in kept]
    rows = list(kept)  # the old embedding row of each new token
    have = set(strings)
    while len(strings) < len(kept) + extra:  # new tokens: two kept tokens' spellings joined
        a, b = rng.sample(kept, 2)
        s = llm_tok.id_to_token(a) + llm_tok.id_to_token(b)
        if a not in special and b not in special and s not in have:
            have.add(s)
            strings.append(s)
            rows.append(a)
    vocab = {s: i for i, s in enumerate(strings)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special.get(2, strings[0])))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special.values()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    model = AutoModelForCausalLM.from_pretrained(str(ssm_dir), dtype=torch.float32)
    index = torch.tensor(rows)
    new_cfg = {**cfg, "vocab_size": len(strings)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int):
            new_cfg[key] = vocab[llm_tok.id_to_token(cfg[key])]
    if max_positions is not None:
        new_cfg["max_position_embeddings"] = max_positions
    new_cfg.pop("transformers_version", None)
    small = AutoModelForCausalLM.from_config(AutoConfig.for_model(**new_cfg)).eval()
    state = model.state_dict()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][index].clone()
    if "lm_head.weight" in state:
        state["lm_head.weight"] = state["lm_head.weight"][index].clone()
    small.load_state_dict(state, strict=False)
    small.tie_weights()
    small.save_pretrained(out)
    return out
