"""``specinfer generate --server``: stream generations from a running stack through the public gRPC API, with the
client's failover between several request managers (:mod:`specinfer.client`)."""

from __future__ import annotations

import argparse
import sys

from specinfer.cli_output import print_logprobs, print_prompt_header
from specinfer.core import InvalidArgument
from specinfer.core.requests import TokenLogprob
from specinfer.generate_cmd import constraint_of
from specinfer.tuning import static_expansion


def client_auth(args: argparse.Namespace):
    """TLS and the bearer token of a request manager, from the client security flags (bad files: InvalidArgument)."""
    from specinfer.serving.security import ClientAuth, ClientTls, read_token

    try:
        auth = ClientAuth(
            ClientTls.from_files(args.tls_ca, args.tls_client_cert, args.tls_client_key),
            read_token(args.auth_token, args.auth_token_file, "auth-token"),
        )
        auth.tls.credentials()
    except ValueError as exc:
        raise InvalidArgument("tls", str(exc)) from None
    return auth


def generate_remote(args: argparse.Namespace) -> int:
    """Stream each prompt's text from a running request manager."""
    auth = client_auth(args)
    for prompt in args.prompt:
        if stream(args.server, args, prompt, auth) != 0:
            return 2
    return 0


def stream(address: str, args: argparse.Namespace, prompt: str, auth=None) -> int:
    """Stream one generation's text to stdout; 0 on success, 2 on an RPC error. ``address``: one request manager
    or several, comma-separated (the client fails over between them, reattaching where the stream stopped)."""
    import grpc

    from specinfer import wire
    from specinfer.client import Client, Failover

    keyword = args.expansion.strip().lower()
    static = None if args.no_speculation else static_expansion(args.expansion)
    request = Client.request(
        prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        verification="" if args.verification == "auto" else args.verification,
        # auto: the server's default (adaptive speculation unless the server runs otherwise)
        expansion=() if static is None else static.widths,
        speculation=not args.no_speculation and keyword not in ("none", "off"),
        suffix=False if args.no_suffix else None,
        logprobs=args.logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
        **_constraint_kwargs(args),
    )
    print_prompt_header(prompt)
    print("--- generated (streamed)", flush=True)
    logprobs: list[TokenLogprob] = []

    def moved(f: Failover) -> None:  # one line per move, on stderr: the text on stdout goes on unbroken
        print(
            f"specinfer: request manager {f.failed} failed ({f.error}); "
            f"reattaching through {f.next} from token {f.received}",
            file=sys.stderr,
            flush=True,
        )

    with Client(address, auth=auth, on_failover=moved) as client:
        try:
            for msg in client.stream(request):
                print(msg.text, end="", flush=True)
                logprobs += wire.token_logprobs_from_proto(msg.logprobs)
                if msg.HasField("finished"):
                    u = msg.finished.usage
                    print(
                        f"\n--- {u.completion_tokens} tokens in {u.llm_steps} LLM steps "
                        f"({u.tokens_per_step:.2f} tokens per LLM step, "
                        f"mean tree size {u.mean_tree_size:.1f}), finish: {api_reason(msg.finished.reason)}",
                        flush=True,
                    )
        except grpc.RpcError as exc:
            print(f"specinfer: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    if args.logprobs is not None:  # no tokenizer here: tokens by ID
        print_logprobs(logprobs, lambda t: f"#{t}")
    return 0


def api_reason(reason: int) -> str:
    from specinfer.v1 import api_pb2

    return api_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def _constraint_kwargs(args: argparse.Namespace) -> dict:
    """The structured-output flags as :meth:`Client.request`'s arguments (the files read here)."""
    constraint = constraint_of(args)
    if constraint is None:
        return {}
    return {constraint.kind: True if constraint.kind == "json_object" else constraint.text}
