"""Python client of the public API (``specinfer.v1.SpecInfer``, protos/specinfer/v1/api.proto).

Stream a generation's text from a running stack (``specinfer up``)::

    from specinfer.client import Client

    with Client("127.0.0.1:50051") as client:
        for text in client.stream_text("def fibonacci(n):\n"):
            print(text, end="", flush=True)

A *request* is an ``api_pb2.GenerateRequest``; :meth:`Client.request` is the one place that builds
it from plain arguments (sampling, speculation, stop conditions). Every method that generates
takes either such a request or a prompt alone (then with :meth:`Client.request`'s defaults).

*Failover*: a client may name several request managers of one stack (``Client("a:50051,b:50052")`` or a
list; every manager serves, reattaches to and cancels any request, docs/request-managers.md). A call
goes to the current one; when it answers UNAVAILABLE (it went away, or it does not hold its lease), the
client moves to the next and calls again. A stream that broke after it started reattaches from the last
token received (``resume_from``), so its tokens and text continue exactly where they stopped, none twice;
one that broke before its first message sends the request again under the same ID (the client picks an
ID when the request has none, so that it can reattach), or reattaches if the first manager had stored
it. A stream keeps trying, round after round over the managers, for ``failover_seconds`` without
progress; a call that reached no manager at all fails at once, as with one address.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from specinfer.serving.security import ClientAuth
from specinfer.v1 import api_pb2, api_pb2_grpc


@dataclass
class Completion:
    """A whole generation, collected from the stream: its ``token_ids`` and ``text`` (the output,
    not the prompt) and the final message's ``finished`` (reason and usage: tokens, LLM steps,
    tokens per step); ``logprobs``: one per token, when the request asked for them."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: api_pb2.Finished | None = None
    logprobs: list[api_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Failover:
    """One move of a call to another request manager: the request (empty for a call that is not a stream),
    the tokens its stream had received, the address that failed and why, and the one tried next."""

    request_id: str
    received: int
    failed: str
    error: str
    next: str


GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")  # targets gRPC itself resolves


def parse_addresses(address: str | Sequence[str]) -> tuple[str, ...]:
    """The request managers ``address`` names: ``host:port``, several separated by commas, or a list of them. A
    gRPC target URI (``dns:///name:port``, ``ipv4:a:p,b:p``) is one entry: gRPC resolves it and connects to the
    first of its addresses that answers."""
    parts = [address] if isinstance(address, str) and address.startswith(GRPC_SCHEMES) else None
    if parts is None:
        parts = address.split(",") if isinstance(address, str) else list(address)
    out = tuple(p.strip() for p in parts if p.strip())
    if not out:
        raise ValueError(f"no request manager address in {address!r}")
    return out


class Client:
    """Blocking client of a request manager, or of several of one stack with failover (module docstring);
    use as a context manager (it closes the channels). ``address``: ``host:port``, several separated by
    commas, or a list; ``timeout``: seconds each call may take (None: no limit; a stream counts as one
    call); ``auth``: TLS files and the bearer token (``--auth-token`` of the request manager) to send, when
    the server requires them; ``failover_seconds``: how long a broken stream keeps trying to reattach
    without progress (0: it raises at once); ``on_failover``: called at each move to another manager."""

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float | None = None,
        auth: ClientAuth | None = None,
        failover_seconds: float = 30.0,
        on_failover: Callable[[Failover], object] | None = None,
    ) -> None:
        self.addresses = parse_addresses(address)
        self.auth = auth or ClientAuth()
        self.timeout = timeout
        self.metadata = self.auth.metadata
        self.failover_seconds = failover_seconds
        self.on_failover = on_failover
        self.current = 0  # index of the request manager calls go to first
        self._channels: dict[int, grpc.Channel] = {}

    @property
    def address(self) -> str:
        """The request manager calls go to now."""
        return self.addresses[self.current]

    @property
    def stub(self) -> api_pb2_grpc.SpecInferStub:
        """The generated stub of the current request manager (no failover: the methods below add it)."""
        if self.current not in self._channels:
            self._channels[self.current] = self.auth.channel(self.address)
        return api_pb2_grpc.SpecInferStub(self._channels[self.current])

    def close(self) -> None:
        """Close the channels (a ``with`` block does it)."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def _move_on(self, exc: grpc.RpcError, request_id: str, received: int) -> None:
        """After UNAVAILABLE from the current manager: a fresh channel to it next time (a channel's reconnect
        backoff would outlast a restart), and the next manager becomes the current one."""
        failed = self.address
        if (channel := self._channels.pop(self.current, None)) is not None:
            channel.close()
        self.current = (self.current + 1) % len(self.addresses)
        if self.on_failover is not None:
            error = str(exc.details() or exc.code().name)
            self.on_failover(Failover(request_id, received, failed, error, self.address))

    def _unary(self, method: str, request):
        """One call, moved to the next manager on UNAVAILABLE until each was tried once."""
        for tries_left in range(len(self.addresses) - 1, -1, -1):
            try:
                return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not tries_left:
                    raise
                self._move_on(exc, "", 0)
        raise AssertionError("unreachable")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        expansion: Sequence[int] = (),
        ssms: Sequence[str] = (),
        speculation: bool = True,
        request_id: str = "",
        adaptive: bool = False,
        ignore_eos: bool = False,
        verification: str = "",
        skip_special_tokens: bool = True,
        suffix: bool | None = None,
        head: bool | None = None,
        logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        min_p: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        **constraint: str | Mapping | bool,
    ) -> api_pb2.GenerateRequest:
        """A generation request. ``prompt``: text (the server's tokenizer encodes it) or token IDs. Sampling:
        ``temperature`` 0 is greedy (the LLM's own greedy output, token for token); ``top_p``/``top_k`` (0: off) filter,
        ``seed`` fixes the draw; ``verification``: how sampled trees are verified ("coupled": a seed fixes the output
        whatever the speculation; "mss"; empty: the server's rule, coupled for seeded requests). It stops after
        ``max_new_tokens``, at EOS (unless ``ignore_eos``), at any of ``stop`` (strings) or ``stop_token_ids``.
        ``skip_special_tokens``: leave EOS and the other special tokens out of the text (token IDs keep them).
        Speculation: by default the server's (``auto``: adaptive); ``adaptive`` asks for adaptive trees, ``expansion``
        for a static tree (widths per depth, e.g. ``(1, 1, 3, 1)``), ``ssms`` names the SSMs that draft
        (``GetModelInfo`` lists them), ``suffix`` turns drafts from the request's own text on or off (None: on),
        ``head`` drafts with the verifier's draft head on or off (None: on, where it has one), ``speculation=False``
        decodes with the LLM alone. ``request_id``: the client's own ID (to resume, read or cancel the request later;
        empty: the server picks one). ``logprobs``: each response also carries its tokens' log-probabilities under the
        LLM, with this many most likely alternatives at each (0-20; None: no logprobs). ``presence_penalty``,
        ``frequency_penalty`` (0: off) and ``repetition_penalty`` (1: off) penalize the tokens seen already,
        ``logit_bias`` adds to given tokens' logits (-100 to 100), ``min_p`` (0: off) drops the tokens less than
        ``min_p`` times as likely as the best. ``constraint``: structured outputs, at most one of ``json_schema`` (a
        dict or JSON text), ``json_object=True``, ``regex``, ``grammar`` (Lark or GBNF)."""
        msg = api_pb2.GenerateRequest(
            request_id=request_id,
            max_new_tokens=max_new_tokens,
            sampling=api_pb2.SamplingParams(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                verification=verification,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
                min_p=min_p,
                logit_bias=dict(logit_bias or {}),
            ),
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
            speculation=api_pb2.SpeculationParams(
                disabled=not speculation,
                expansion=list(expansion),
                ssms=list(ssms),
                adaptive=adaptive,
                suffix=suffix,
                head=head,
            ),
            ignore_eos=ignore_eos,
            skip_special_tokens=skip_special_tokens,
        )
        if seed is not None:
            msg.sampling.seed = seed
        if logprobs is not None:
            msg.logprobs = logprobs
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.token_ids.ids.extend(prompt)
        return _constrained(msg, **constraint)

    def resume(self, request_id: str, offset: int) -> Iterator[api_pb2.GenerateResponse]:
        """Reattach to a request: its tokens from ``offset`` on, then new ones until it finishes."""
        return self.stream(api_pb2.GenerateRequest(request_id=request_id, resume_from=offset))

    def stream(self, request: api_pb2.GenerateRequest | str) -> Iterator[api_pb2.GenerateResponse]:
        """The response messages of a generation as they come: each carries new ``token_ids`` from
        ``offset`` and their ``text``; the last one also ``finished``. ``request``: a request
        (:meth:`request`) or a prompt. Fails over between the request managers (module docstring); raises
        ``grpc.RpcError`` (e.g. INVALID_ARGUMENT naming the field, or UNAVAILABLE once failover gave up).
        Closing the iterator early cancels the call, and with it the request."""
        if isinstance(request, str):
            request = self.request(request)
        if not request.request_id:  # an ID of our own, to reattach with
            request = api_pb2.GenerateRequest.FromString(request.SerializeToString())
            request.request_id = uuid.uuid4().hex
        return self._stream(request)

    def _stream(self, request: api_pb2.GenerateRequest) -> Iterator[api_pb2.GenerateResponse]:
        rid = request.request_id
        start = request.resume_from if request.HasField("resume_from") else 0
        received = 0  # tokens received, from ``start``
        opened = request.HasField("resume_from")  # the server has the request: reattach from now on
        stalled_since: float | None = None  # the first failure since the last message
        failures = 0  # calls in a row that failed
        while True:
            ask = api_pb2.GenerateRequest(request_id=rid, resume_from=start + received) if opened else request
            call = self.stub.Generate(ask, timeout=self.timeout, metadata=self.metadata)
            try:
                for msg in call:
                    opened, stalled_since, failures = True, None, 0
                    received += len(msg.token_ids)
                    yield msg
                return
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.ALREADY_EXISTS and failures and not opened:
                    opened = True  # the manager that failed had stored it: reattach from its first token
                    continue
                now = time.monotonic()
                stalled_since = now if stalled_since is None else stalled_since
                failures += 1
                reached_none = not opened and failures >= len(self.addresses)  # fail fast, as with one address
                if code != grpc.StatusCode.UNAVAILABLE or reached_none or now - stalled_since >= self.failover_seconds:
                    raise
                self._move_on(exc, rid, received)
                if failures >= len(self.addresses):  # every manager tried since the last message: wait a little
                    time.sleep(min(2.0, 0.1 * 2 ** (failures // len(self.addresses))))
            finally:
                call.cancel()  # a no-op once it ended; else the request is cancelled with the call

    def stream_text(self, request: api_pb2.GenerateRequest | str) -> Iterator[str]:
        """The generated text, piece by piece as it streams (see :meth:`stream`)."""
        for msg in self.stream(request):
            if msg.text:
                yield msg.text

    def generate(self, request: api_pb2.GenerateRequest | str) -> Completion:
        """The whole generation at once (see :meth:`stream`)."""
        out = Completion()
        for msg in self.stream(request):
            out.request_id = msg.request_id
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            out.logprobs.extend(msg.logprobs)
            if msg.HasField("finished"):
                out.finished = msg.finished
        return out

    def cancel(self, request_id: str) -> bool:
        """Stop a running request (its stream ends with reason CANCELLED); False if it was not running."""
        return self._unary("Cancel", api_pb2.CancelRequest(request_id=request_id)).cancelled

    def get_request(self, request_id: str) -> api_pb2.RequestState:
        """A request's status and the tokens it has committed so far (NOT_FOUND if unknown)."""
        return self._unary("GetRequest", api_pb2.GetRequestRequest(request_id=request_id))

    def model_info(self) -> api_pb2.ModelInfo:
        """What the server serves: the LLM's and the SSMs' names, vocabulary, limits, default speculation."""
        return self._unary("GetModelInfo", api_pb2.GetModelInfoRequest())


def _constrained(
    msg: api_pb2.GenerateRequest,
    json_schema: str | Mapping | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
) -> api_pb2.GenerateRequest:
    """``msg`` with its ``constraint`` oneof set from :meth:`Client.request`'s arguments (ValueError: more than one)."""
    given = {
        "json_schema": json_schema if isinstance(json_schema, str | None) else json.dumps(json_schema),
        "json_object": json_object or None,
        "regex": regex,
        "grammar": grammar,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"at most one constraint: {', '.join(given)}")
    for name, value in given.items():
        setattr(msg, name, value)
    return msg
