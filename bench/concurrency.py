"""Speculation under load: the default against no speculation and the paper's static tree, at each concurrency.

One stack (``specinfer up``'s processes, one of each, on free ports, the request manager's batch as large as the
largest concurrency) serves every row, without prefix caching unless ``--prefix-caching on``: every row takes the
prompt file's prompts in the same order, so with it every row after the first would find its prompts' KV cached (at
16 streams on the 1B pair the first row's steps that prefilled took 377 ms against the next row's 141). With it on,
every prompt is computed once before the first row (one token each), so that every row finds them cached.

At each concurrency C, C client threads keep one gRPC stream each going (requests of ``--new-tokens`` tokens,
prompts of the prompt file in turn) for each method; the methods of a concurrency run one after the other, in the
order given (``--repeats`` rounds, every other one in reverse order, each row summing its rounds: a machine whose
speed drifts favours no method), after a warm-up run of the default (the speculation gate and the cost model learn
the batch size as a user's traffic would teach them). A row is measured in steady state: its streams start spread
over ``--settle-seconds``, unmeasured (not a burst of C prompts prefilled at once, after which requests of the same
length would start and end together forever), then ``--seconds`` measured (tokens that arrive in the window, the
request manager's metrics scraped as it opens and closes); as it closes every stream is cut, so no tail of a few
late requests running at a small batch counts either (which method's requests finish together and which spread out
would otherwise decide the row as much as its speed). Prints per row: committed tokens per second over all streams,
tokens per LLM step, the per-token latency's p50 and p99 (a message's gap spread over its tokens; the first message
is time to first token, left out), the speed against ``none`` at that concurrency, and the cost model's median error
on the row's verify calls and on its whole iterations (the request manager's
``specinfer_cost_model_verify_error_ratio`` and ``specinfer_cost_model_step_error_ratio``; ``-`` where nothing was
predicted), the mean tree nodes verified per request and step (the root included: 1 is no speculation) and the
accepted tokens the planner predicted for the steps it speculated against those realised (``predicted/realised``:
how the acceptance model is calibrated), and the mean iteration's milliseconds with its drafting and verification
parts, the mean batch of an iteration and the share of the row's seconds the manager spent in iterations (``busy``;
the rest: admission, finishing requests, waiting for work), the requests preempted for lack of KV blocks (each
computes its context again when it is back), and the speculation gate's committed tokens per second
with speculation on and off at the row's batch-size bucket as the row closed (what the gate decides by).

Methods: ``default`` (the server's default speculation: adaptive with the SSMs and the suffix drafts), ``none``
(speculation disabled), ``paper`` (the paper's static expansion ``<1,1,3,1,1,1,1,1>``) or any widths ``a,b,c``.

    python bench/concurrency.py --llm models/demo/llm --ssm models/demo/ssm --prompts models/demo/prompts.jsonl \\
        --concurrency 1,2,4,8,16,32 --seconds 20 --settle-seconds 15 --new-tokens 48
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common import delta, histogram_quantile, load_prompts, pct, scrape

from specinfer.client import Client
from specinfer.core import ExpansionConfig
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.core.head_gate import bucket
from specinfer.launcher import Stack, StackConfig

REPO = Path(__file__).resolve().parents[1]
ERROR = "specinfer_cost_model_verify_error_ratio"  # the request manager's histogram of the cost model's errors
STEP_ERROR = "specinfer_cost_model_step_error_ratio"  # the same on whole iterations
TREE = "specinfer_tree_size"  # tree nodes verified per request and step, the root included
PREDICTED = "specinfer_predicted_accepted_tokens_total"
REALISED = "specinfer_realised_accepted_tokens_total"
GATE = "specinfer_speculation_gate_tokens_per_second"  # the speculation gate's measured rates, by bucket and arm
PARTS = ("iteration", "speculate", "verify")  # the request manager's histograms of an iteration and its two parts


@dataclass
class Row:
    """What the client threads of one (concurrency, method) run counted, under ``lock``: ``tokens`` and ``per_token``
    gaps that arrived inside the measured window, ``done_tokens`` and ``done_steps`` of the requests that finished
    (any time in the run: tokens per step), and the window's ``seconds``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    tokens: int = 0
    per_token: list[float] = field(default_factory=list)
    done_tokens: int = 0
    done_steps: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Window:
    """A run's clock: streams start spread over ``settle`` seconds, unmeasured, then ``seconds`` are measured; at the
    end every stream is cut (closing it cancels its request), so no tail of a few late requests counts either."""

    start: float
    settle: float
    seconds: float

    @property
    def opens(self) -> float:
        return self.start + self.settle

    @property
    def closes(self) -> float:
        return self.opens + self.seconds


def request(method: str, prompt: tuple[int, ...], args, seed: int | None):
    """One request of ``method``; ``seed``: the draw's (with ``--seeded``; None: unseeded, verified by MSS)."""
    sampling = {"temperature": args.temperature, "seed": seed}
    if method == "default":
        return Client.request(prompt, args.new_tokens, ignore_eos=True, **sampling)
    if method == "none":
        return Client.request(prompt, args.new_tokens, speculation=False, ignore_eos=True, **sampling)
    widths = ExpansionConfig.parse(PAPER_EXPANSION if method == "paper" else method).widths
    return Client.request(prompt, args.new_tokens, expansion=widths, ignore_eos=True, **sampling)


def stream_until(client: Client, method: str, prompts, first: int, step: int, args, window: Window, row: Row) -> None:
    """One client thread: streams back to back (prompts ``first``, ``first + step``, ...) until ``window`` closes,
    counting what arrives inside it. Thread ``first`` of ``step`` starts ``first / step`` of the way into the settling
    time, so the streams' requests start, and end, spread out as a server's traffic does."""
    time.sleep(max(0.0, window.start + window.settle * first / step - time.monotonic()))
    k = first
    while time.monotonic() < window.closes:
        prompt = prompts[k % len(prompts)]
        k += step
        last, lat, count, steps, tokens = None, [], 0, 0, 0
        seed = k if args.seeded else None  # seeded requests are verified by coupled verification
        for msg in client.stream(request(method, prompt, args, seed)):
            now = time.monotonic()
            if now > window.closes:
                break  # leaving the loop closes the stream: the request is cancelled
            n = len(msg.token_ids)
            tokens += n
            if n and now >= window.opens:
                if last is not None:  # the first message's gap is time to first token
                    lat += [(now - last) / n] * n
                count += n
            last = now if n else last
            if msg.HasField("finished"):
                steps = msg.finished.usage.llm_steps
        with row.lock:
            row.tokens += count
            row.per_token += lat
            if steps:
                row.done_tokens += tokens
                row.done_steps += steps


def prefill_all(client: Client, prompts, streams: int = 8) -> None:
    """Every prompt once (one token, no speculation), ``streams`` at a time: with prefix caching on, every row then
    finds the prompts' whole blocks cached, the first row too (else it alone computes them)."""
    with ThreadPoolExecutor(streams) as pool:
        done = [pool.submit(client.generate, Client.request(p, 1, speculation=False, ignore_eos=True)) for p in prompts]
    for d in done:
        d.result()  # raises what a request raised


def run(
    client: Client, method: str, prompts, concurrency: int, args, row: Row | None = None, rm=None
) -> tuple[Row, dict[str, float], dict[str, float]]:
    """``concurrency`` streams of ``method`` through a window of ``args.settle_seconds`` then ``args.seconds``,
    counted into ``row`` (a new one by default); with ``rm`` (the request manager's process) its metrics are scraped
    as the window opens and closes. Returns the row, the metric deltas over the window and the metrics as it closed."""
    row = row if row is not None else Row()
    window = Window(time.monotonic(), args.settle_seconds, args.seconds)
    threads = [
        threading.Thread(target=stream_until, args=(client, method, prompts, i, concurrency, args, window, row))
        for i in range(concurrency)
    ]
    for t in threads:
        t.start()
    counted: dict[str, float] = {}
    closing: dict[str, float] = {}
    if rm is not None:
        time.sleep(max(0.0, window.opens - time.monotonic()))
        before = scrape(rm.metrics_address)
        time.sleep(max(0.0, window.closes - time.monotonic()))
        closing = scrape(rm.metrics_address)
        counted = {key: value - before.get(key, 0.0) for key, value in closing.items()}
    for t in threads:
        t.join()
    row.seconds += window.seconds
    return row, counted, closing


def gate_rates(closing: dict[str, float], concurrency: int) -> str:
    """The speculation gate's measured tokens/s with speculation on and off at this concurrency's batch-size bucket,
    as a row closed (what it decides by; ``-`` where an arm has not been measured)."""
    largest = 1 << bucket(concurrency)
    rates = [closing.get(f"{GATE}{{arm={arm},batch={largest}}}", 0.0) for arm in ("on", "off")]
    return "/".join(f"{r:.0f}" if r else "-" for r in rates)


def breakdown(counted: dict[str, float], seconds: float) -> str:
    """What a row is made of, as table cells, from its metric deltas ``counted`` over ``seconds``: mean tree nodes
    per request-step, predicted/realised accepted tokens, the mean iteration's ms with its drafting and verification
    parts, the mean batch, the share of the seconds the manager spent in iterations, and the requests it preempted for
    lack of KV blocks (each computes its context again when it is back)."""
    steps = delta({}, counted, f"{TREE}_count")
    nodes = f"{delta({}, counted, f'{TREE}_sum') / steps:.2f}" if steps else "-"
    predicted, realised = delta({}, counted, PREDICTED), delta({}, counted, REALISED)
    iterations = max(1.0, delta({}, counted, "specinfer_batch_size_count"))
    ms = [1e3 * delta({}, counted, f"specinfer_{part}_seconds_sum") / iterations for part in PARTS]
    batch = delta({}, counted, "specinfer_batch_size_sum") / iterations
    return (
        f"{nodes} | {predicted:.0f}/{realised:.0f} | {ms[0]:.1f} ({ms[1]:.1f} + {ms[2]:.1f}) | "
        f"{batch:.2f} | {delta({}, counted, 'specinfer_iteration_seconds_sum') / seconds:.0%} | "
        f"{delta({}, counted, 'specinfer_preemptions_total'):.0f}"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, default=REPO / "models/demo/llm")
    ap.add_argument("--ssm", type=Path, action="append", default=None, help="an SSM folder; repeat for several")
    ap.add_argument("--head", type=Path, default=None, help="a draft head of the LLM")
    ap.add_argument("--prompts", type=Path, default=REPO / "models/demo/prompts.jsonl")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="each prompt cut to its last this many tokens")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--methods", default="default,none,paper")
    ap.add_argument("--seconds", type=float, default=20.0, help="per row and round")
    ap.add_argument(
        "--repeats", type=int, default=1, help="rounds of the methods per concurrency, alternating their order"
    )
    ap.add_argument("--warmup-seconds", type=float, default=10.0, help="of the default, before each concurrency")
    ap.add_argument(
        "--settle-seconds", type=float, default=10.0, help="of each row, its streams starting spread over them"
    )
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seeded", action="store_true", help="with --temperature: seeded requests (coupled verification)")
    ap.add_argument("--threads", type=int, default=0, help="the verifier's torch threads (0: torch's default)")
    ap.add_argument("--speculation-gate", choices=("on", "off"), default="on", help="the request manager's")
    ap.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="off",
        help="the verifier's and SSM workers' (on: every row after the first finds the prompts cached)",
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    ssms = args.ssm if args.ssm is not None else [REPO / "models/demo/ssm"]
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    prompts = load_prompts(args.prompts, args.llm, 64, args.prompt_tokens)
    cfg = StackConfig(
        llm=args.llm,
        ssms=tuple(ssms),
        port=0,
        state_dir=Path(tempfile.mkdtemp()),
        expansion="auto",
        threads=args.threads,
        extra_env=(("SPECINFER_DTYPE", args.dtype),),
        rm_args=("--max-batch", str(max(levels)), "--speculation-gate", args.speculation_gate),
        head=args.head,
        model_args=("--prefix-caching", args.prefix_caching),
    )
    draws = "greedy" if not args.temperature else f"temperature {args.temperature}, {'' if args.seeded else 'un'}seeded"
    print(
        f"LLM {args.llm}, SSMs {[str(s) for s in ssms]}, dtype {args.dtype}, {draws}, {args.new_tokens} new tokens, "
        f"{args.seconds:.0f} s measured per row (after {args.settle_seconds:.0f} s) x {args.repeats} rounds, "
        f"speculation gate {args.speculation_gate}, prefix caching {args.prefix_caching}"
    )
    columns = ("tokens/s", "tokens per step", "p50 ms/token", "p99 ms/token", "vs none", "verify error p50")
    columns += ("step error p50", "tree nodes", "predicted/realised accepted", "iteration ms (draft + verify)")
    columns += ("mean batch", "busy", "preempted", "gate on/off tokens/s")
    print("| concurrency | method | " + " | ".join(columns) + " |")
    print("|---:|---|" + "---:|" * len(columns))
    with Stack(cfg) as stack, Client(stack.address, timeout=600, failover_seconds=0) as client:
        rm = stack.process("request-manager")
        if args.prefix_caching == "on":
            prefill_all(client, prompts)
        for c in levels:
            if args.warmup_seconds > 0:
                warmup = {"seconds": args.warmup_seconds / 2, "settle_seconds": args.warmup_seconds / 2}
                run(client, "default", prompts, c, argparse.Namespace(**{**vars(args), **warmup}))
            rows = {m: Row() for m in methods}
            counted: dict[str, dict[str, float]] = {m: {} for m in methods}  # each method's metric deltas, summed
            closing: dict[str, dict[str, float]] = {}  # each method's metrics as its last window closed
            for repeat in range(args.repeats):
                # rounds alternate the methods' order, so a drifting machine does not favour the first
                for m in methods if repeat % 2 == 0 else methods[::-1]:
                    _, window, closing[m] = run(client, m, prompts, c, args, rows[m], rm)
                    for key, value in window.items():
                        counted[m][key] = counted[m].get(key, 0.0) + value
            errors = {
                m: tuple(histogram_quantile({}, counted[m], n, 0.5) for n in (ERROR, STEP_ERROR)) for m in methods
            }
            base = rows.get("none")
            for m, row in rows.items():
                rate = row.tokens / row.seconds
                versus = f"{rate / (base.tokens / base.seconds):.2f}" if base is not None and base.tokens else ""
                error = " | ".join(f"{e:.3f}" if e is not None else "-" for e in errors[m])
                print(
                    f"| {c} | {m} | {rate:.1f} | {row.done_tokens / max(1, row.done_steps):.2f} | "
                    f"{pct(row.per_token, 50) * 1e3:.1f} | {pct(row.per_token, 99) * 1e3:.1f} | {versus} | {error} | "
                    f"{breakdown(counted[m], row.seconds)} | {gate_rates(closing[m], c)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
