"""Python client of the public API (``specinfer.v1.SpecInfer``, protos/specinfer/v1/api.proto).

Stream a generation's text from a running stack (``specinfer up``)::

    from specinfer.client import Client

    with Client("127.0.0.1:50051") as client:
        for text in client.stream_text("def fibonacci(n):\n"):
            print(text, end="", flush=True)

A *request* is an ``api_pb2.GenerateRequest``; :meth:`Client.request` is the one place that builds
it from plain arguments (sampling, speculation, stop conditions). Every method that generates
takes either such a request or a prompt alone (then with :meth:`Client.request`'s defaults).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

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


class Client:
    """Blocking client of one request manager; use as a context manager (it closes the channel).
    ``address`` is ``host:port``; ``timeout``: seconds each call may take (None: no limit; a
    stream counts as one call); ``auth``: TLS files and the bearer token (``--auth-token`` of the
    request manager) to send, when the server requires them."""

    def __init__(self, address: str, timeout: float | None = None, auth: ClientAuth | None = None) -> None:
        self.auth = auth or ClientAuth()
        self.channel = self.auth.channel(address)
        self.stub = api_pb2_grpc.SpecInferStub(self.channel)
        self.timeout = timeout
        self.metadata = self.auth.metadata

    def close(self) -> None:
        """Close the channel (a ``with`` block does it)."""
        self.channel.close()

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
    ) -> api_pb2.GenerateRequest:
        """A generation request. ``prompt``: text (the server's tokenizer encodes it) or token IDs.
        Sampling: ``temperature`` 0 is greedy (the LLM's own greedy output, token for token);
        ``top_p``/``top_k`` (0: off) filter, ``seed`` fixes the draw; ``verification``: how sampled
        trees are verified ("coupled": a seed fixes the output whatever the speculation; "mss"; empty:
        the server's rule, coupled for seeded requests). It stops after ``max_new_tokens``, at EOS
        (unless ``ignore_eos``), at any of ``stop`` (strings) or ``stop_token_ids``.
        ``skip_special_tokens``: leave EOS and the other special tokens out of the text (token IDs
        keep them). Speculation: by default the server's (``auto``: adaptive); ``adaptive`` asks for
        adaptive trees, ``expansion`` for a static tree (widths per depth, e.g. ``(1, 1, 3, 1)``),
        ``ssms`` names the SSMs that draft (``GetModelInfo`` lists them), ``suffix`` turns drafts from
        the request's own text on or off (None: on), ``head`` drafts with the verifier's draft head on or off
        (None: on, where it has one), ``speculation=False`` decodes with the LLM alone.
        ``request_id``: the client's own ID (to resume, read or cancel the request later; empty: the
        server picks one). ``logprobs``: each response also carries its tokens' log-probabilities under the LLM,
        with this many most likely alternatives at each (0-20; None: no logprobs). ``presence_penalty``,
        ``frequency_penalty`` (0: off) and ``repetition_penalty`` (1: off) penalize the tokens seen already,
        ``logit_bias`` adds to given tokens' logits (-100 to 100), ``min_p`` (0: off) drops the tokens less than
        ``min_p`` times as likely as the best."""
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
        return msg

    def resume(self, request_id: str, offset: int) -> Iterator[api_pb2.GenerateResponse]:
        """Reattach to a request: its tokens from ``offset`` on, then new ones until it finishes."""
        return self.stream(api_pb2.GenerateRequest(request_id=request_id, resume_from=offset))

    def stream(self, request: api_pb2.GenerateRequest | str) -> Iterator[api_pb2.GenerateResponse]:
        """The response messages of a generation as they come: each carries new ``token_ids`` from
        ``offset`` and their ``text``; the last one also ``finished``. ``request``: a request
        (:meth:`request`) or a prompt. Raises ``grpc.RpcError`` (e.g. INVALID_ARGUMENT naming the field)."""
        if isinstance(request, str):
            request = self.request(request)
        return self.stub.Generate(request, timeout=self.timeout, metadata=self.metadata)

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
        return self.stub.Cancel(
            api_pb2.CancelRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata
        ).cancelled

    def get_request(self, request_id: str) -> api_pb2.RequestState:
        """A request's status and the tokens it has committed so far (NOT_FOUND if unknown)."""
        return self.stub.GetRequest(
            api_pb2.GetRequestRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata
        )

    def model_info(self) -> api_pb2.ModelInfo:
        """What the server serves: the LLM's and the SSMs' names, vocabulary, limits, default speculation."""
        return self.stub.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)
