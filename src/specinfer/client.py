"""Python client of the public API (``specinfer.v1.SpecInfer``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from specinfer.serving.security import ClientAuth
from specinfer.v1 import api_pb2, api_pb2_grpc


@dataclass
class Completion:
    """A whole generation, collected from the stream."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: api_pb2.Finished | None = None


class Client:
    """Blocking client; ``address`` is ``host:port``; ``auth``: TLS files and the bearer token
    (``--auth-token`` of the request manager) to send, when the server requires them."""

    def __init__(self, address: str, timeout: float | None = None, auth: ClientAuth | None = None) -> None:
        self.auth = auth or ClientAuth()
        self.channel = self.auth.channel(address)
        self.stub = api_pb2_grpc.SpecInferStub(self.channel)
        self.timeout = timeout
        self.metadata = self.auth.metadata

    def close(self) -> None:
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
        skip_special_tokens: bool = True,
    ) -> api_pb2.GenerateRequest:
        """``skip_special_tokens``: leave EOS and the other special tokens out of the text (token IDs keep them)."""
        msg = api_pb2.GenerateRequest(
            request_id=request_id,
            max_new_tokens=max_new_tokens,
            sampling=api_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
            speculation=api_pb2.SpeculationParams(disabled=not speculation, expansion=list(expansion), ssms=list(ssms), adaptive=adaptive),
            ignore_eos=ignore_eos,
            skip_special_tokens=skip_special_tokens,
        )
        if seed is not None:
            msg.sampling.seed = seed
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.token_ids.ids.extend(prompt)
        return msg

    def resume(self, request_id: str, offset: int) -> Iterator[api_pb2.GenerateResponse]:
        """Reattach to a request: its tokens from ``offset`` on, then new ones until it finishes."""
        return self.stream(api_pb2.GenerateRequest(request_id=request_id, resume_from=offset))

    def stream(self, request: api_pb2.GenerateRequest) -> Iterator[api_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=self.timeout, metadata=self.metadata)

    def generate(self, request: api_pb2.GenerateRequest) -> Completion:
        out = Completion()
        for msg in self.stream(request):
            out.request_id = msg.request_id
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            if msg.HasField("finished"):
                out.finished = msg.finished
        return out

    def cancel(self, request_id: str) -> bool:
        return self.stub.Cancel(api_pb2.CancelRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata).cancelled

    def get_request(self, request_id: str) -> api_pb2.RequestState:
        return self.stub.GetRequest(api_pb2.GetRequestRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata)

    def model_info(self) -> api_pb2.ModelInfo:
        return self.stub.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)
