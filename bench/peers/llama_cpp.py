"""Side by side with llama.cpp, one command: same LLM/SSM pair, prompts, new tokens, threads and dtype.

Fetches llama.cpp's source (the ``llama-cpp-python`` sdist from PyPI, which carries it under
``vendor/llama.cpp``), builds ``llama-completion``, ``llama-speculative-simple`` and ``llama-bench``
(cmake Release, native CPU flags; once, cached), converts both models to GGUF in ``--dtype`` with
llama.cpp's ``convert_hf_to_gguf.py`` (cached by folder, mtime and dtype), then runs every prompt,
greedy and batch 1, row after row (interleaved per prompt):

- llama.cpp incremental (``llama-completion``) and llama.cpp speculative with the SSM as its draft
  model (``llama-speculative-simple --spec-type draft-simple``, a sweep of ``--spec-draft-n-max``
  over ``--draft-max`` and ``--spec-draft-p-min`` over ``--draft-p-min``; ``--spec-draft-n-min 0``);
- ours in this process: incremental (``--no-speculation``), static trees (the tuner's pick where the
  SSM has one installed, and the paper's ``1,1,3,1,1,1,1,1``) and ``auto`` (adaptive, the default);
- with ``--through-services``, ours again through the local stack (``specinfer up``'s processes),
  after all the other rows: the stack's idle processes would take CPU from them.

A public model without a draft model, on the weights people run: ``--ssm none`` (llama.cpp incremental, ours
incremental and ``auto``), ``--gguf FILE`` (llama.cpp runs that file, e.g. a package's Q4_1 GGUF, instead of the
``--llm`` folder converted; ``--gguf-type q8_0`` converts it to llama.cpp's Q8_0) and ``--quantize int8|int4``
(our weight-only quantization of ``--llm``, in this process).

tokens/s are *decode* rates: the prompt's prefill is left out (llama.cpp's own "eval"/"decoded"
timings; ours: the time after each request's first LLM step, which prefills and already speculates,
as in bench/compare.py). Tokens per step: llama.cpp
speculative's committed / target decodes (``n_predict / (n_predict - n_accept)``), ours from the
engine. "greedy text = llama.cpp" compares each prompt's text with llama.cpp incremental's, as a
prefix match (speculative llama.cpp may run a token past ``-n``); it is reported, not asserted: in
bfloat16 near-ties can round differently in two implementations. Caches (source, build, converter
venv, GGUF files) live in ``--cache``, outside the repository. Writes ``OUT/llama_cpp.{json,md}`` (by default
in ``~/.cache/specinfer/peers/results``: a run leaves nothing in the repository; BENCHMARKS.md's records pass
``--out bench/results/peers``).

    python bench/peers/llama_cpp.py --llm /tmp/pycode-a-llm-1b --ssm ../shared/models/pycode-a/ssm \\
        --prompts ../shared/models/pycode-a/prompts.jsonl --count 5 --new-tokens 64 --dtype bfloat16 \\
        --threads 2 --out bench/results/peers
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpp_tools import PIN, Toolchain

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models/demo"
PAPER = "1,1,3,1,1,1,1,1"
INCREMENTAL = ("llama.cpp", "incremental (llama-completion)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", type=Path, default=DEMO / "llm", help="Hugging Face folder of the LLM")
    ap.add_argument(
        "--ssm", default=str(DEMO / "ssm"), help="Hugging Face folder of the SSM (llama.cpp's draft); none: no SSM rows"
    )
    ap.add_argument(
        "--gguf", type=Path, help="llama.cpp's LLM from this GGUF file (a quantized one) instead of --llm converted"
    )
    ap.add_argument(
        "--gguf-type",
        default="",
        choices=["", "q8_0"],
        help="the type --llm is converted to for llama.cpp (empty: --dtype's; q8_0: llama.cpp's 8-bit blocks of 32, "
        "beside our --quantize int8)",
    )
    ap.add_argument("--quantize", default="none", choices=["none", "int8", "int4"], help="our LLM's weights")
    ap.add_argument("--prompts", type=Path, default=DEMO / "prompts.jsonl", help="JSON lines with 'prompt' or 'text'")
    ap.add_argument("--count", type=int, default=5, help="prompts to run (the first N)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of every row (llama.cpp -t/-tb/-td; torch)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of every row (GGUF bf16/f32)")
    ap.add_argument("--draft-max", default="4,8,16", help="llama.cpp speculative: --draft-max values to sweep")
    ap.add_argument("--draft-p-min", default="0,0.5", help="llama.cpp speculative: --draft-p-min values to sweep")
    ap.add_argument("--trees", default=f"{PAPER};tuned", help="our static trees, ';'-separated (tuned: the SSM's pick)")
    ap.add_argument("--ctx", type=int, default=0, help="llama.cpp context size (0: the model's)")
    ap.add_argument("--through-services", action="store_true", help="also our rows through the local stack")
    ap.add_argument("--skip-ours", action="store_true", help="llama.cpp rows only")
    ap.add_argument("--no-bench", action="store_true", help="skip the llama-bench reference row")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/specinfer/peers/llama_cpp")
    # outside the repository by default: a run leaves nothing in the clone (records go to bench/results on purpose)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/specinfer/peers/results")
    args = ap.parse_args(argv)
    args.draft_max = [int(x) for x in args.draft_max.split(",") if x.strip()]
    args.draft_p_min = [float(x) for x in args.draft_p_min.split(",") if x.strip()]
    if args.count <= 0 or args.new_tokens <= 0 or args.threads <= 0:
        ap.error("--count, --new-tokens and --threads must be positive")
    args.ssm = None if args.ssm == "none" else Path(args.ssm)
    if args.quantize != "none" and args.through_services:
        ap.error("--quantize: our rows in this process only")
    return args


def load_prompts(path: Path, count: int) -> list[str]:
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(row["prompt"] if "prompt" in row else row["text"])
    return prompts[:count]


def same_text(a: str, b: str) -> bool:
    """Equal up to the shorter one's length (one side may have stopped a token later)."""
    return a.startswith(b) or b.startswith(a)


def summarise(samples: dict[tuple[str, str], list[dict]], bench: dict | None = None) -> list[dict]:
    """One row per (system, setting): decode tokens/s over all prompts, tokens per step, ratios and
    how many prompts' greedy text equals llama.cpp incremental's."""
    reference = samples.get(INCREMENTAL, [])
    rows = []
    for (system, setting), runs in samples.items():
        seconds = sum(s["decode_seconds"] for s in runs)
        decoded = sum(s["decode_tokens"] for s in runs)
        steps = [s.get("steps") for s in runs]
        row = {
            "system": system,
            "setting": setting,
            "prompts": len(runs),
            "tokens": sum(s["tokens"] for s in runs),
            "decode_tokens": decoded,
            "decode_seconds": round(seconds, 4),
            "tokens_per_second": round(decoded / seconds, 3) if seconds > 0 and decoded > 0 else None,
            "tokens_per_step": round(sum(s["tokens"] for s in runs) / sum(steps), 3) if steps and all(steps) else None,
        }
        if all(s.get("n_drafted") for s in runs):  # llama.cpp speculative: accepted / drafted tokens
            row["draft_acceptance"] = round(sum(s["n_accept"] for s in runs) / sum(s["n_drafted"] for s in runs), 3)
        if reference and (system, setting) != INCREMENTAL:
            same = sum(same_text(s["text"], r["text"]) for s, r in zip(runs, reference, strict=True))
            row["greedy_text_equals_llama_cpp"] = f"{same}/{len(runs)}"
        rows.append(row)
    if bench is not None:
        rows.insert(0, bench)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """tokens/s relative to llama.cpp's best speculative row and to llama.cpp incremental."""
    spec = [
        r
        for r in rows
        if r["system"] == "llama.cpp" and r["setting"].startswith("speculative") and r["tokens_per_second"]
    ]
    best = max(spec, key=lambda r: r["tokens_per_second"], default=None)
    inc = next((r for r in rows if (r["system"], r["setting"]) == INCREMENTAL), None)
    for r in rows:
        tps = r["tokens_per_second"]
        r["vs_llama_cpp_best_speculative"] = round(tps / best["tokens_per_second"], 3) if best and tps else None
        r["vs_llama_cpp_incremental"] = (
            round(tps / inc["tokens_per_second"], 3) if inc and inc["tokens_per_second"] and tps else None
        )
        r["best_llama_cpp_speculative"] = r is best


def markdown(rows: list[dict]) -> str:
    def fmt(v, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    head = ("system", "setting", "tokens/s", "tokens/step", "vs llama.cpp best spec", "vs llama.cpp incremental")
    lines = ["| " + " | ".join((*head, "greedy text = llama.cpp")) + " |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        setting = r["setting"] + (" **(best)**" if r.get("best_llama_cpp_speculative") else "")
        lines.append(
            f"| {r['system']} | {setting} | {fmt(r['tokens_per_second'], 1)} | {fmt(r['tokens_per_step'])} "
            f"| {fmt(r['vs_llama_cpp_best_speculative'])} | {fmt(r['vs_llama_cpp_incremental'])} "
            f"| {r.get('greedy_text_equals_llama_cpp', '-')} |"
        )
    return "\n".join(lines)


def llama_cases(args: argparse.Namespace) -> list[tuple[str, int, float]]:
    """(setting, draft max, p-min); draft max 0: incremental."""
    cases = [(INCREMENTAL[1], 0, 0.0)]
    for n in args.draft_max if args.ssm is not None else ():
        cases += [(f"speculative draft-max {n} p-min {p:g}", n, p) for p in args.draft_p_min]
    return cases


def progress(prompt: int, system: str, setting: str, sample: dict) -> None:
    rate = sample["decode_tokens"] / sample["decode_seconds"] if sample["decode_seconds"] > 0 else float("nan")
    print(f"prompt {prompt} {system} {setting}: {rate:.1f} tokens/s, {sample['tokens']} tokens", flush=True)


def ours_on_prompt(system: str, runner, methods: list, i: int, prompt: str, new_tokens: int, samples: dict) -> None:
    for method in methods:
        s = asdict(runner.run(prompt, method, new_tokens))
        samples.setdefault((system, method.setting), []).append(s)
        progress(i, system, method.setting, s)


def collect(args: argparse.Namespace, tools: Toolchain, ggufs: tuple[Path, Path], prompts: list[str]) -> dict:
    """llama.cpp and ours in this process, interleaved per prompt (prompt 0 on every case, then prompt 1,
    ...); then, with --through-services, ours through the stack, started only now: its idle processes
    would take CPU from the other rows (llama.cpp's worker threads spin while they wait)."""
    from ours import InProcess, ThroughServices, methods

    samples: dict[tuple[str, str], list[dict]] = {}
    our_methods = methods(args.trees.split(";"), args.ssm)
    engine = None
    if not args.skip_ours:
        engine = InProcess(args.llm, args.ssm, args.dtype, args.threads, args.quantize)
        engine.warm_up(prompts[0], our_methods)
    for i, prompt in enumerate(prompts):
        for setting, n, p in llama_cases(args):
            if n == 0:
                s = tools.completion(ggufs[0], prompt, args.new_tokens, args.threads, args.ctx)
            else:
                s = tools.speculative(ggufs, prompt, args.new_tokens, args.threads, args.ctx, n, p)
            samples.setdefault(("llama.cpp", setting), []).append(s)
            progress(i, "llama.cpp", setting, s)
        if engine is not None:
            ours_on_prompt("specinfer", engine, our_methods, i, prompt, args.new_tokens, samples)
    del engine
    if args.through_services:
        stack = ThroughServices(args.llm, args.ssm, args.dtype, args.threads)
        try:
            stack.warm_up(prompts[0], our_methods)
            for i, prompt in enumerate(prompts):
                ours_on_prompt("specinfer services", stack, our_methods, i, prompt, args.new_tokens, samples)
        finally:
            stack.close()
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts, args.count)
    tools = Toolchain(args.cache, jobs=args.jobs)
    tools.prepare()
    llm_gguf = args.gguf.resolve() if args.gguf else tools.convert(args.llm, args.gguf_type or args.dtype)
    ggufs = (llm_gguf, tools.convert(args.ssm, args.dtype) if args.ssm is not None else None)
    bench = None if args.no_bench else tools.bench(ggufs[0], args.new_tokens, args.threads)
    samples = collect(args, tools, ggufs, prompts)
    rows = summarise(samples, bench)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "llm": str(args.llm),
        "ssm": str(args.ssm),
        "ggufs": [str(g) for g in ggufs if g is not None],
        "quantize": args.quantize,
        "gguf_type": args.gguf_type or args.dtype,
        "prompts": str(args.prompts),
        "count": len(prompts),
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "dtype": args.dtype,
        "llama_cpp": tools.version(),
        "llama_cpp_python_sdist": PIN,
        "build_seconds": tools.build_seconds(),
        "command": " ".join(sys.argv),
    }
    texts = {f"{k[0]} | {k[1]}": [s["text"] for s in v] for k, v in samples.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llama_cpp.json").write_text(json.dumps({"meta": meta, "rows": rows, "texts": texts}, indent=1))
    table = markdown(rows)
    (args.out / "llama_cpp.md").write_text(table + "\n")
    print(table)
    print(f"wrote {args.out / 'llama_cpp.json'} and {args.out / 'llama_cpp.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
