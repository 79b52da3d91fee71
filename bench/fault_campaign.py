"""A randomized fault campaign against the local stack (issue 20).

The stack: the LLM verifier, two SSM workers serving one SSM, the request manager with its
embedded Redis, all processes on 127.0.0.1 (:class:`specinfer.launcher.Stack`). Each round starts
``--streams`` concurrent requests, half greedy (adaptive speculation) and half seeded sampling
(a static tree), then, mid-stream, hits a random subset of the processes: kill -9 or SIGSTOP
(SIGCONT after a while); a killed request manager takes its Redis with it (it stops with its
owner) or, at random, has it killed -9 too. Killed processes are restarted in random order
without waiting for each other (so a restart overlaps another's start-up), and at random one of
them is killed again during its own start-up and restarted once more. Every client reattaches
through the public API (``resume_from`` its received tokens; a request the manager never stored
is sent again) until its request finishes.

Checks, per request: greedy output equals transformers' greedy decoding; seeded sampling output
equals the same request's output on the undisturbed stack (run before the first round); no token
offset repeats (duplicated) or skips (lost). At the end: no process of the stack and no
redis-server on its state dir is left running.

Why at most one of the two workers per round: under sampling the tokens drawn depend on the draft
trees, which stay the same as long as a worker of the SSM drafts them (drafts are seeded per
request and step); with both workers down the requests decode without drafts and draw other
(equally distributed, but not equal) samples. Greedy outputs do not depend on drafts at all. For
the same reason a round starts only once the request manager has taken both workers back into
service (its specinfer_ssm_workers_live gauge): a restarted worker that answers its own health check
is not yet drafting, and a fault on the other one meanwhile leaves none. Recovery time runs from the
fault to that point; re-adoption time is its last part, from every process serving to the manager
using both workers again.

    python bench/fault_campaign.py --llm ../shared/models/pycode-a/llm --ssm ../shared/models/pycode-a/ssm \\
        --prompts ../shared/models/pycode-a/prompts.jsonl --rounds 200 --out bench/results/faults
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import torch
from fault_client import Outcome, run_client
from transformers import AutoModelForCausalLM

from specinfer.checkpoint import load_tokenizer
from specinfer.client import Client
from specinfer.launcher import Stack, StackConfig
from specinfer.v1 import api_pb2

SAMPLING_TREE = (1, 1, 3, 1)


def alive_pids_of(workdir: Path) -> list[int]:
    """Processes whose command line or working directory mentions ``workdir`` (the stack's own
    processes and the redis-server on its state dir)."""
    out = []
    needle = str(workdir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
            state = (entry / "stat").read_text().split(") ")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and (needle in cmdline or cwd.startswith(needle)):
            out.append(int(entry.name))
    return out


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        self.workdir = Path(tempfile.mkdtemp(prefix="specinfer-faults-"))
        cfg = StackConfig(
            llm=Path(args.llm),
            ssms=(Path(args.ssm),),
            workers=2,
            port=0,
            state_dir=self.workdir / "state",
            threads=1,
            rm_args=("--max-batch", "16", "--ssm-failure-seconds", "3", "--rpc-timeout-seconds", "10"),
            # fp32, the exactness oracle's dtype: --dtype auto is bf16 on AVX512-BF16/AMX CPUs, whose greedy
            # output is bf16's own (near-tied tokens flip), not transformers' fp32 output checked here
            model_args=("--dtype", "float32"),
        )
        self.stack = Stack(cfg, workdir=self.workdir)
        self.hf = AutoModelForCausalLM.from_pretrained(args.llm, dtype=torch.float32)
        self.tokenizer = load_tokenizer(args.llm)
        self.faults: Counter[str] = Counter()
        self.rows: list[dict] = []
        self.round = 0
        self.readoption = 0.0  # last round: from every process serving to the manager using both workers

    def token_prompt(self, i: int) -> list[int]:
        """Prompt ``i`` (cycling), its last ``--max-prompt-tokens`` tokens."""
        p = self.prompts[i % len(self.prompts)]
        ids = list(p["token_ids"]) if "token_ids" in p else self.tokenizer.encode(p["text"]).ids
        return ids[-self.args.max_prompt_tokens :]

    def greedy(self, prompt: list[int]) -> list[int]:
        n = self.args.new_tokens
        with torch.inference_mode():
            out = self.hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    def requests(self, r: int, prompts: list[list[int]]) -> list[tuple[api_pb2.GenerateRequest, str]]:
        """Round ``r``'s requests: even streams greedy (adaptive), odd ones seeded sampling (static tree)."""
        out = []
        for i, prompt in enumerate(prompts):
            rid = f"round{r}-s{i}"
            if i % 2 == 0:
                out.append(
                    (
                        Client.request(prompt, self.args.new_tokens, request_id=rid, ignore_eos=True, adaptive=True),
                        "greedy",
                    )
                )
            else:
                req = Client.request(
                    prompt,
                    self.args.new_tokens,
                    request_id=rid,
                    ignore_eos=True,
                    temperature=0.9,
                    top_p=0.95,
                    seed=1000 + i,
                    expansion=SAMPLING_TREE,
                )
                out.append((req, "sampling"))
        return out

    def references(self, prompts: list[list[int]]) -> dict[int, list[int]]:
        """Undisturbed outputs: transformers' greedy, and the seeded sampling requests on the healthy stack."""
        refs = {}
        deadline = time.monotonic() + 600
        for i, (req, kind) in enumerate(self.requests(-1, prompts)):
            if kind == "greedy":
                refs[i] = self.greedy(list(req.token_ids.ids))
            else:
                refs[i] = run_client(self.stack.address, req, deadline).tokens
        return refs

    def pick_faults(self) -> list[tuple[str, str]]:
        """A non-empty random subset of {one worker, the verifier, the manager}, each with a fault kind
        (``--only``: the given fault sets, one per round in turn)."""
        if self.args.only:
            sets = self.args.only.split(";")
            chosen = sets[self.round % len(sets)]
            return [tuple(f.strip().split(" ", 1)) for f in chosen.split(",")]  # type: ignore[misc]
        worker = f"ssm-worker-{self.rng.randrange(2)}"
        while True:
            chosen = [n for n in (worker, "llm-verifier", "request-manager") if self.rng.random() < 0.5]
            if chosen:
                break
        faults = []
        for name in chosen:
            kind = self.rng.choice(["kill", "stop"])
            if name == "request-manager" and kind == "kill" and self.rng.random() < 0.5:
                kind = "kill+redis"
            faults.append((name, kind))
        return faults

    def inject(self, faults: list[tuple[str, str]]) -> None:
        for name, kind in faults:
            proc = self.stack.process(name)
            if kind == "stop":
                proc.popen.send_signal(signal.SIGSTOP)
            else:
                redis_pid = self.redis_pid() if kind == "kill+redis" else None
                proc.popen.kill()
                if redis_pid is not None:
                    os.kill(redis_pid, signal.SIGKILL)
                proc.popen.wait()
            self.faults[f"{name} {kind}"] += 1

    def redis_pid(self) -> int | None:
        try:
            return int((self.stack.config.state_dir / "redis.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def recover(self, faults: list[tuple[str, str]]) -> None:
        """SIGCONT the stopped ones after a while; restart the killed ones in random order without
        waiting for each other, at random killing one again during its start-up; then wait until
        every process is SERVING."""
        stopped = [n for n, k in faults if k == "stop"]
        killed = [n for n, k in faults if k != "stop"]
        self.rng.shuffle(killed)
        timers = []
        for name in stopped:
            pause = self.args.stop_seconds or self.rng.uniform(0.5, 4.0)
            t = threading.Timer(pause, self.stack.process(name).popen.send_signal, (signal.SIGCONT,))
            t.start()
            timers.append(t)
        restarted = []
        for name in killed:
            time.sleep(self.rng.uniform(0.0, 1.0))
            restarted.append(self.stack.respawn(name, wait=False))
        if restarted and self.rng.random() < 0.3:  # a fault during start-up, while others start too
            victim = self.rng.choice(restarted)
            time.sleep(self.rng.uniform(0.0, 1.5))
            victim.popen.kill()
            victim.popen.wait()
            self.faults[f"{victim.name} kill during start-up"] += 1
            restarted = [p for p in restarted if p is not victim]
            restarted.append(self.stack.respawn(victim.name, wait=False))
        for t in timers:
            t.join()
        for proc in restarted:
            self.stack.wait_ready(proc, 300)
        ready = time.monotonic()
        self.wait_workers_adopted(60)
        self.readoption = time.monotonic() - ready

    def wait_workers_adopted(self, timeout: float) -> None:
        """Wait until the request manager has both workers in service again (its
        specinfer_ssm_workers_live gauge), so the next round's single worker fault never leaves the
        SSM with none: a worker's process answering is not yet the manager having taken it back."""
        url = f"http://{self.stack.process('request-manager').metrics_address}/metrics"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    text = reply.read().decode()
                live = [
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("specinfer_ssm_workers_live{")
                ]
                if live and min(live) >= self.stack.config.workers:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the request manager did not take every SSM worker back in {timeout:.0f} s")
            time.sleep(0.05)

    def run(self) -> dict:
        started = time.monotonic()
        self.stack.start()
        try:
            prompts = [self.token_prompt(i) for i in range(self.args.streams)]
            refs = self.references(prompts)
            totals = Counter()
            max_recovery = max_readoption = 0.0
            for r in range(self.args.rounds):
                self.round = r
                reqs = self.requests(r, prompts)
                deadline = time.monotonic() + 600
                live = [Outcome() for _ in reqs]
                with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
                    futures = [
                        pool.submit(run_client, self.stack.address, req, deadline, o)
                        for (req, _), o in zip(reqs, live, strict=True)
                    ]
                    # mid-stream: once every stream has tokens, at a random moment within the window
                    wait_until = time.monotonic() + 60
                    while not all(o.tokens for o in live) and time.monotonic() < wait_until:
                        time.sleep(0.01)
                    time.sleep(self.rng.uniform(0.0, self.args.fault_window))
                    midway = sum(o.finished is None for o in live)
                    faults = self.pick_faults()
                    hit = time.monotonic()
                    self.inject(faults)
                    self.recover(faults)
                    recovery = time.monotonic() - hit
                    outcomes = [f.result(timeout=900) for f in futures]
                max_recovery = max(max_recovery, recovery)
                max_readoption = max(max_readoption, self.readoption)
                exact = sum(o.tokens == refs[i] for i, o in enumerate(outcomes))
                row = {
                    "round": r,
                    "faults": [f"{n} {k}" for n, k in faults],
                    "requests": len(outcomes),
                    "unfinished_at_fault": midway,
                    "exact": exact,
                    "duplicated": sum(o.duplicated for o in outcomes),
                    "lost": sum(o.lost for o in outcomes),
                    "retries": sum(o.retries for o in outcomes),
                    "resubmitted": sum(o.resubmitted for o in outcomes),
                    "recovery_seconds": round(recovery, 2),
                    "readoption_seconds": round(self.readoption, 2),
                }
                for i, o in enumerate(outcomes):
                    if o.tokens != refs[i]:
                        print(f"round {r} stream {i} ({reqs[i][1]}) differs: {o.tokens} != {refs[i]}", flush=True)
                self.rows.append(row)
                totals.update(
                    {k: row[k] for k in ("requests", "exact", "duplicated", "lost", "retries", "resubmitted")}
                )
                print(json.dumps(row), flush=True)
        finally:
            for p in self.stack.processes:  # a stopped process cannot handle SIGTERM
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGCONT)
            self.stack.stop()
        time.sleep(1.0)
        orphans = alive_pids_of(self.workdir)
        return {
            "rounds": self.args.rounds,
            "streams": self.args.streams,
            "new_tokens": self.args.new_tokens,
            "faults": dict(sorted(self.faults.items())),
            **totals,
            "exact_percent": round(100.0 * totals["exact"] / max(1, totals["requests"]), 2),
            "max_recovery_seconds": round(max_recovery, 2),
            "max_readoption_seconds": round(max_readoption, 2),
            "orphans": len(orphans),
            "seconds": round(time.monotonic() - started, 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", required=True)
    ap.add_argument("--ssm", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl of {'text': ...} or {'token_ids': [...]}")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=48)
    ap.add_argument(
        "--fault-window",
        type=float,
        default=1.0,
        help="faults land within this many seconds after every stream has tokens",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-seconds", type=float, default=0.0, help="how long a SIGSTOP lasts (0: 0.5-4 s at random)")
    ap.add_argument(
        "--only",
        default="",
        help='fixed faults, e.g. "ssm-worker-0 kill,request-manager stop"; sets separated by ";" take turns, '
        "one per round (reproducing a sequence)",
    )
    ap.add_argument("--out", help="folder for summary.json and rounds.jsonl")
    args = ap.parse_args()
    # SIGTERM (kill, a CI time-out) unwinds like Ctrl-C, so run()'s finally stops the stack: no orphans
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    campaign = Campaign(args)
    summary = campaign.run()
    print()
    print(
        "| rounds | requests | exact % | duplicated | lost | client retries | resubmitted | max recovery s "
        "| max re-adoption s | orphans | seconds |"
    )
    print("| --- " * 11 + "|")
    s = summary
    print(
        f"| {s['rounds']} | {s['requests']} | {s['exact_percent']} | {s['duplicated']} | {s['lost']} | {s['retries']} "
        f"| {s['resubmitted']} | {s['max_recovery_seconds']} | {s['max_readoption_seconds']} | {s['orphans']} "
        f"| {s['seconds']} |"
    )
    print()
    print("| fault | count |")
    print("| --- | --- |")
    for k, v in s["faults"].items():
        print(f"| {k} | {v} |")
    print()
    print(json.dumps(summary))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in campaign.rows))


if __name__ == "__main__":
    main()
