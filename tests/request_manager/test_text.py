"""Incremental detokenization with special tokens (services/request_manager/api/text.py): EOS and the other
special tokens stay out of the text by default, the streamed deltas concatenate to the final text, and
stop strings still cut it."""

from __future__ import annotations

import pytest

from specinfer.models.tiny import SPECIAL_TOKENS, byte_tokenizer
from specinfer.request_manager.api.text import TextStream, output_text

BOS, EOS, UNK = range(len(SPECIAL_TOKENS))


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer().backend_tokenizer


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream_in_steps(stream: TextStream, tokens: list[int], step: int) -> tuple[list[str], bool]:
    """Feed ``tokens`` ``step`` at a time as the scheduler does; the deltas, and whether a stop string ended it."""
    deltas = []
    for end in range(step, len(tokens) + step, step):
        delta, stopped = stream.update(tokens[:end])
        deltas.append(delta)
        if stopped:
            return deltas, True
    deltas.append(stream.flush(tokens))
    return deltas, False


def output_with_specials(tok) -> list[int]:
    """EOS first (the reported bug: a greedy completion whose first token is EOS), a BOS inside a
    two-byte character, a special token between words, EOS last."""
    e_acute = ids(tok, "é")
    assert len(e_acute) == 2  # byte-level: a special token can fall between the bytes of one character
    return [EOS, *ids(tok, "caf"), e_acute[0], BOS, e_acute[1], UNK, *ids(tok, " au lait €"), EOS]


@pytest.mark.parametrize("step", [1, 2, 3, 100])
def test_special_tokens_left_out_and_deltas_add_up(tok, step):
    tokens = output_with_specials(tok)
    deltas, stopped = stream_in_steps(TextStream(tok, ()), tokens, step)
    assert not stopped
    assert "".join(deltas) == "café au lait €" == output_text(tok, tokens, (), True, finished=True)
    assert not any("<" in d for d in deltas)


@pytest.mark.parametrize("step", [1, 3])
def test_special_tokens_kept_when_asked(tok, step):
    tokens = output_with_specials(tok)
    deltas, _ = stream_in_steps(TextStream(tok, (), skip_special_tokens=False), tokens, step)
    text = "".join(deltas)
    assert text.startswith("</s>caf") and text.endswith("€</s>") and "<s>" in text and "<unk>" in text
    assert text == tok.decode(tokens, skip_special_tokens=False) == output_text(tok, tokens, (), False, finished=True)


def test_only_eos_is_the_empty_text(tok):
    stream = TextStream(tok, ())
    assert stream.update([EOS]) == ("", False)
    assert stream.flush([EOS]) == "" and stream.text == ""


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_strings_with_special_tokens(tok, step):
    tokens = output_with_specials(tok)
    # a stop string spanning a skipped special token (between "café" and " au") is found in the text
    deltas, stopped = stream_in_steps(TextStream(tok, ("é au",)), tokens, step)
    assert stopped and "".join(deltas) == "caf" == output_text(tok, tokens, ("é au",), True, finished=True)
    # a stop string spelling a special token matches only where special tokens are in the text
    deltas, stopped = stream_in_steps(TextStream(tok, ("</s>",)), tokens, step)
    assert not stopped and "".join(deltas) == "café au lait €"
    deltas, stopped = stream_in_steps(TextStream(tok, ("<unk>",), skip_special_tokens=False), tokens, step)
    kept = tok.decode(tokens, skip_special_tokens=False)  # "</s>caf?<s>?<unk> au...": BOS kept splits the "é"
    assert stopped and "".join(deltas) == kept[: kept.index("<unk>")] == output_text(
        tok, tokens, ("<unk>",), False, finished=True
    )


def test_fresh_keeps_the_rule_and_the_stop_strings(tok):
    stream = TextStream(tok, ("lait",), skip_special_tokens=False)
    stream.update(ids(tok, "x"))
    probe = stream.fresh()
    assert probe.text == "" and probe.skip_special_tokens is False
    assert probe.update([EOS, *ids(tok, "au lait")]) == ("</s>au ", True)


@pytest.mark.parametrize("skip", [True, False])
def test_the_rule_survives_the_redis_record(tok, skip):
    """A request resumed from Redis (restart, adoption) decodes as it asked, and GetRequest's text is its stream's."""
    from specinfer.core import SamplingParams
    from specinfer.core.requests import GenerationRequest
    from specinfer.request_manager.api.admission import ApiLimits
    from specinfer.request_manager.scheduling.live import Live
    from specinfer.request_manager.state.live_records import live_from_snapshot, live_params, snapshot_text
    from specinfer.request_manager.state.records import RequestSnapshot, RequestStatus

    limits = ApiLimits(
        vocab_size=259,
        max_positions=512,
        max_new_tokens=64,
        default_expansion=(),
        default_ssms=(),
        ssm_names=(),
        draft_support=8,
        llm_name="llm",
        eos_token_id=EOS,
    )
    live = Live(GenerationRequest("r", (5, 6), 16, SamplingParams()), 1, ("lait",), TextStream(tok, ("lait",), skip))
    params = live_params(live, ())
    tokens = tuple(output_with_specials(tok))
    snapshot = RequestSnapshot(
        "r", "me", RequestStatus.RUNNING, params, (5, 6), tokens[:4], None, None, live.stats, 0.0, 0.0
    )
    assert live_from_snapshot(snapshot, limits, tok).text.skip_special_tokens is skip
    finished = RequestSnapshot(
        "r", "me", RequestStatus.FINISHED, params, (5, 6), tokens, None, None, live.stats, 0.0, 0.0
    )
    assert snapshot_text(finished, tok) == (
        "café au " if skip else tok.decode(list(tokens), skip_special_tokens=False).split("lait")[0]
    )
    older = RequestSnapshot(
        "r",
        "me",
        RequestStatus.FINISHED,
        {k: v for k, v in params.items() if k != "skip_special_tokens"},
        (5, 6),
        tokens,
        None,
        None,
        live.stats,
        0.0,
        0.0,
    )
    assert snapshot_text(older, tok) == "café au "  # a record written before the field: the default, skip
