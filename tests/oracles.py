"""What the end-to-end tests compare with and how they hold a stack, in one place: transformers'
greedy output (the exactness oracle, fp32), transformers' seeded sampling by the Gumbel-max rule of
coupled verification (the oracle of seeded requests), and a local stack that must stop cleanly on SIGTERM."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specinfer.launcher import Stack, StackConfig
from specinfer.models.loading import eos_token_id


def hf_greedy(
    llm: Path, prompts: Sequence[Sequence[int]], new_tokens: int, ignore_eos: bool = False
) -> list[list[int]]:
    """transformers' fp32 greedy continuation of each prompt (``new_tokens`` at most), ending at the
    checkpoint's EOS token included, as our services end a request; ``ignore_eos``: exactly
    ``new_tokens``, past any EOS (as requests with ``ignore_eos`` run)."""
    hf = AutoModelForCausalLM.from_pretrained(str(llm), dtype=torch.float32)
    eos = eos_token_id(llm)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            if ignore_eos:
                gen = hf.generate(
                    torch.tensor([list(ids)]),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                out.append(gen[0, len(ids) :].tolist())
                continue
            gen = hf.generate(
                torch.tensor([list(ids)]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
            tokens = gen[0, len(ids) :].tolist()
            out.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


def hf_constrained_greedy(llm: Path, prompts: Sequence[Sequence[int]], new_tokens: int, states) -> list[list[int]]:
    """Constrained incremental decoding with transformers (fp32, its KV cache, as ``generate``): at each step the
    argmax of the logits with the tokens the grammar forbids set to -inf, one token at a time; ``states``: each
    prompt's fresh grammar state (:class:`specinfer.core.constraints.GrammarState`). Ends at EOS included."""
    from specinfer.core.constraints import allowed_tokens

    hf = AutoModelForCausalLM.from_pretrained(str(llm), dtype=torch.float32)
    eos = eos_token_id(llm)
    out = []
    with torch.inference_mode():
        for ids, state in zip(prompts, states, strict=True):
            tokens: list[int] = []
            step = hf(torch.tensor([list(ids)]), use_cache=True)
            while len(tokens) < new_tokens and (not tokens or tokens[-1] != eos):
                if tokens:
                    step = hf(torch.tensor([tokens[-1:]]), past_key_values=step.past_key_values, use_cache=True)
                logits = step.logits[0, -1]
                allowed = torch.from_numpy(allowed_tokens(state.mask(), logits.shape[0]))
                token = int(allowed[logits[allowed].argmax()])
                tokens.append(token)
                if token != eos:
                    state.advance([token])
            out.append(tokens)
    return out


def hf_seeded_sampling(
    llm: Path, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params, new_tokens: int, ignore_eos: bool = False
) -> list[list[int]]:
    """Plain decoding with transformers (fp32, no cache: every step runs the whole sequence): the token
    at sequence index t is ``coupled_token(process_logits(logits, params), position_noise(seed, t, V))``,
    the rule coupled verification reproduces whatever the speculation (``specinfer.core.coupled``).
    Ends at EOS included, unless ``ignore_eos``."""
    from specinfer.core import process_logits
    from specinfer.core.coupled import coupled_token, position_noise

    hf = AutoModelForCausalLM.from_pretrained(str(llm), dtype=torch.float32)
    eos = eos_token_id(llm)
    out = []
    with torch.inference_mode():
        for ids, seed in zip(prompts, seeds, strict=True):
            seq = list(ids)
            while len(seq) - len(ids) < new_tokens and (ignore_eos or len(seq) == len(ids) or seq[-1] != eos):
                logits = hf(torch.tensor([seq])).logits[0, -1].double().numpy()
                seq.append(coupled_token(process_logits(logits, params), position_noise(seed, len(seq), logits.size)))
            out.append(seq[len(ids) :])
    return out


@contextmanager
def serving(config: StackConfig) -> Iterator[Stack]:
    """The local stack of ``config``, started; when the block ends it is stopped with SIGTERM, and
    every process must exit 0 (an unclean shutdown fails the test)."""
    stack = Stack(config).start()
    try:
        yield stack
    finally:
        codes = stack.stop()
    assert codes == dict.fromkeys(codes, 0), f"unclean shutdown on SIGTERM: {codes}"


def hf_logprobs(llm: Path, prompt: Sequence[int], output: Sequence[int]):
    """transformers' fp32 log-softmax before each output token, from one forward over prompt and output
    ``[len(output), V]`` (float64)."""
    model = AutoModelForCausalLM.from_pretrained(str(llm), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([[*prompt, *output]])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), dim=-1)


def hf_plain_decoding(hf, prompt: Sequence[int], params, seed: int | None, new_tokens: int) -> list[int]:
    """Decoding without speculation or cache with the transformers model ``hf``, one token at a time from the whole
    sequence's logits, penalized by the reference (:func:`specinfer.core.sampling.adjust_logits`): the argmax (greedy)
    or the coupled Gumbel-max draw of the seed (as :func:`hf_seeded_sampling`); exactly ``new_tokens``."""
    import numpy as np

    from specinfer.core import process_logits
    from specinfer.core.coupled import coupled_token, position_noise
    from specinfer.core.sampling import adjust_logits

    seq = list(prompt)
    with torch.inference_mode():
        while len(seq) - len(prompt) < new_tokens:
            logits = hf(torch.tensor([seq])).logits[0, -1].double().numpy()
            x = adjust_logits(logits, prompt, seq[len(prompt) :], params)
            if params.greedy:
                seq.append(int(np.argmax(x)))
            else:
                seq.append(coupled_token(process_logits(x, params), position_noise(seed, len(seq), x.size)))
    return seq[len(prompt) :]
