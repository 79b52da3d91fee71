"""The default speculation from the first call (issue 34, item 2): ``specinfer generate`` with its
default (``--expansion auto``, adaptive) against ``--no-speculation``, first-ever and warm.

Each row runs ``specinfer generate`` as a fresh process, as a user would:

- *no speculation*: ``--no-speculation`` (no cost model at all);
- *first-ever*: the default with a new, empty calibration cache folder: the engine probes the
  models' step costs (~1 s), the real steps refine them, and the run writes them to the folder;
- *warm*: the default again with that folder: the refined cost model is read, nothing is timed.

Tokens/s is the output tokens over the seconds ``specinfer generate`` reports for its generation
(everything after loading: the probe of a first-ever run included); the process's wall time, model
loading included, is shown too. Runs of one repeat go in turn (no speculation, first-ever, warm, per
batch) so a slow spell of the machine touches all of them; the table keeps each row's median.
Targets (issue 34): first-ever >= 0.9x no speculation; warm >= 1.0x at batch 1, >= 0.98x at batch 8.

On an otherwise idle machine (each repeat runs 6 generations, ~3 minutes for a 1B model in bf16 on
2 CPU cores):

    python bench/inflate_llm.py ../shared/models/pycode-a/llm /tmp/llm-1b --params 1e9 --dtype bfloat16
    python bench/first_call.py --llm /tmp/llm-1b --ssm ../shared/models/pycode-a/ssm \\
        --prompts ../shared/models/pycode-a/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SUMMARY = re.compile(
    r"^=== (\d+) request\(s\), .*: (\d+) tokens in (\d+) LLM steps \(([\d.]+) tokens/step\), ([\d.]+) s$", re.MULTILINE
)
TARGETS = {("first-ever", 1): 0.9, ("first-ever", 8): 0.9, ("warm", 1): 1.0, ("warm", 8): 0.98}


@dataclass(frozen=True)
class Run:
    tokens: int
    steps: int
    seconds: float  # what specinfer generate reports: its generation, after loading
    wall: float  # the whole process

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def generate(args: argparse.Namespace, prompts: list[str], flags: list[str]) -> Run:
    cmd = [
        sys.executable,
        "-m",
        "specinfer.cli",
        "generate",
        "--llm",
        args.llm,
        "--ssm",
        args.ssm,
        "--dtype",
        args.dtype,
    ]
    cmd += ["--max-new-tokens", str(args.new_tokens), *flags, *prompts]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    match = SUMMARY.search(done.stdout)
    if done.returncode != 0 or match is None:
        sys.exit(
            f"specinfer generate failed ({done.returncode}): {' '.join(cmd[:12])} ...\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return Run(int(match[2]), int(match[3]), float(match[5]), wall)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", required=True)
    p.add_argument("--ssm", required=True)
    p.add_argument(
        "--prompts", required=True, help="JSON lines with a 'text' field (the first line is skipped: it loops at once)"
    )
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--dtype", default="bfloat16", help="passed to specinfer generate (issue 34 measures bf16)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    texts = [json.loads(line)["text"] for line in Path(args.prompts).read_text().splitlines()[1:] if line.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[tuple[str, int], list[Run]] = {}
    for r in range(args.repeats):
        for batch in batches:
            prompts = texts[:batch]
            with tempfile.TemporaryDirectory(prefix="specinfer-calibration-") as cache:
                for mode, flags in (
                    ("no speculation", ["--no-speculation", "--calibration-cache", "none"]),
                    ("first-ever", ["--calibration-cache", cache]),
                    ("warm", ["--calibration-cache", cache]),
                ):
                    if mode == "warm" and not list(Path(cache).glob("engine-*.json")):
                        sys.exit("the first-ever run wrote no calibration cache entry")
                    run = generate(args, prompts, flags)
                    runs.setdefault((mode, batch), []).append(run)
                    say = (
                        f"repeat {r + 1}, batch {batch}, {mode}: {run.tokens_per_second:.2f} tokens/s, "
                        f"{run.seconds:.2f} s, wall {run.wall:.1f} s"
                    )
                    print(say, file=sys.stderr)
    print(
        f"specinfer generate, {args.new_tokens} new tokens per prompt, --dtype {args.dtype}, "
        f"median of {args.repeats} runs"
    )
    print()
    print("| batch | run | tokens/s | x no speculation | target | tokens/step | generate s | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in batches:
        base = statistics.median(x.tokens_per_second for x in runs[("no speculation", batch)])
        for mode in ("no speculation", "first-ever", "warm"):
            rs = runs[(mode, batch)]
            tps = statistics.median(x.tokens_per_second for x in rs)
            target = TARGETS.get((mode, batch))
            verdict = "" if target is None else f">= {target:.2f} ({'met' if tps / base >= target else 'MISSED'})"
            per_step = statistics.median(x.tokens / x.steps for x in rs)
            print(
                f"| {batch} | {mode} | {tps:.2f} | {tps / base:.2f} | {verdict} | {per_step:.2f} | "
                f"{statistics.median(x.seconds for x in rs):.2f} | {statistics.median(x.wall for x in rs):.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
