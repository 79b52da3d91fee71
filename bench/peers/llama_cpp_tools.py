"""llama.cpp for ``bench/peers/llama_cpp.py``: fetch its source, build it, convert models, run it, parse
its timings. Everything it writes lives under the cache folder (default
``~/.cache/specinfer/peers/llama_cpp``), outside the repository:

    dist/        the llama-cpp-python sdist (pip download)     src/    its extracted tree (converter patched)
    build/bin/   llama-completion, llama-speculative-simple, llama-bench (cmake Release, native CPU flags, no AMX)
    convert-venv/ a venv for convert_hf_to_gguf.py: sentencepiece, the rest read from this interpreter's site-packages
    stage/       each model folder as the converter sees it (links, plus a tokenizer_config.json naming BOS/EOS use)
    gguf/        converted models, keyed by folder path, file mtimes, dtype and the pin
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

PIN = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp: ggml 0.25.3, llama.cpp commit 0c1e570
TARGETS = ("llama-completion", "llama-speculative-simple", "llama-bench")
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "q8_0": "q8_0"}  # convert_hf_to_gguf.py --outtype
PATCH_MARK = "# specinfer: a tokenizer the converter does not list"
PATCH_ANCHOR = '        if res is None:\n            logger.warning("\\n")\n'
PATCH = f"""        if res is None and os.environ.get("SPECINFER_TOKENIZER_PRE"):  {PATCH_MARK}
            res = os.environ["SPECINFER_TOKENIZER_PRE"]
"""

_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTS = re.compile(r"(?:^|\s)(n_draft|n_predict|n_drafted|n_accept)\s+=\s+(\d+)$", re.M)


def parse_completion(stderr: str) -> tuple[int, float]:
    """``llama-completion``'s decode: (tokens evaluated after the prompt, seconds), from
    ``llama_perf_context_print:        eval time = ... ms / N runs``."""
    found = _EVAL.findall(stderr)
    if not found:
        raise ValueError("no 'eval time' line in llama-completion's output")
    ms, runs = found[-1]
    return int(runs), float(ms) / 1000


def parse_speculative(stderr: str) -> dict:
    """``llama-speculative-simple``'s summary: decoded tokens, seconds and the draft counters."""
    decoded = _DECODED.search(stderr)
    if decoded is None:
        raise ValueError("no 'decoded N tokens in S seconds' line in llama-speculative-simple's output")
    out = {"decoded": int(decoded.group(1)), "seconds": float(decoded.group(2))}
    out.update({k: int(v) for k, v in _COUNTS.findall(stderr)})
    if not {"n_predict", "n_drafted", "n_accept"} <= out.keys():
        raise ValueError("llama-speculative-simple's n_predict/n_drafted/n_accept lines are missing")
    return out


def parse_bench(stdout: str) -> float:
    """Mean tokens/s of ``llama-bench -o json``'s (single) test."""
    return float(json.loads(stdout)[0]["avg_ts"])


def pre_tokenizer(model_dir: Path) -> str:
    """The name llama.cpp gives the tokenizer's pre-tokenizer: GPT-2's byte-level regex is "gpt-2"."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    if (
        pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and not tok.get("normalizer")
    ):
        return "gpt-2"
    raise SystemExit(
        f"{model_dir}: pre-tokenizer {pre} is not GPT-2's byte-level regex; teach pre_tokenizer() its llama.cpp name"
    )


def special_tokens_added(model_dir: Path) -> tuple[bool, bool]:
    """Whether our tokenizer (tokenizers' post-processor) adds BOS / EOS around a prompt, as llama.cpp must."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    plain, full = tok.encode("x", add_special_tokens=False).ids, tok.encode("x").ids
    start = full.index(plain[0]) if plain and plain[0] in full else 0
    return start > 0, len(full) > start + len(plain)


def _run(cmd: list, log: Path | None = None, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)
    if log is not None:
        log.write_text(f"$ {' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise RuntimeError(f"{Path(str(cmd[0])).name} exited {proc.returncode}: {' '.join(map(str, cmd))}\n{tail}")
    return proc


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # the compiler flags of a build without llama.cpp's AMX kernels


def cpu_has_amx() -> bool:
    """Whether this CPU lists AMX (Linux's /proc/cpuinfo; False elsewhere)."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


class Toolchain:
    """llama.cpp's source, binaries and converter in ``cache``."""

    def __init__(self, cache: Path, jobs: int = 2, log=print) -> None:
        self.cache = cache.expanduser().resolve()
        self.jobs = jobs
        self.log = log
        self.bin = self.cache / "build" / "bin"

    @property
    def source(self) -> Path:
        return self.cache / "src" / f"llama_cpp_python-{PIN}" / "vendor" / "llama.cpp"

    def prepare(self) -> None:
        self.fetch()
        self.build()
        self.patch_converter()

    def fetch(self) -> None:
        sdist = self.cache / "dist" / f"llama_cpp_python-{PIN}.tar.gz"
        if not sdist.exists():
            self.log(f"llama.cpp: pip download llama-cpp-python=={PIN} (sdist) into {sdist.parent}")
            cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
            _run([*cmd, f"llama-cpp-python=={PIN}", "-d", sdist.parent])
        if not (self.source / "convert_hf_to_gguf.py").exists():
            with tarfile.open(sdist) as tar:
                kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(self.cache / "src", **kw)

    def _cmake(self) -> tuple[str, str]:
        cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
        if cmake is None:  # PyPI's cmake and ninja, into this interpreter's environment
            _run([sys.executable, "-m", "pip", "install", "cmake", "ninja"])
            scripts = Path(sysconfig.get_paths()["scripts"])
            cmake, ninja = str(scripts / "cmake"), str(scripts / "ninja")
        return cmake, ninja or ""

    def build(self) -> None:
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
        flags += ["-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]
        if cpu_has_amx():
            # llama.cpp's AMX matrix kernels (Q4_1, Q8_0) stop with SIGILL in its worker threads on the AMX Xeon VM
            # we met (a tile instruction before any tile configuration): built without them, its AVX-512 VNNI
            # kernels run instead (BENCHMARKS.md, "llama.cpp on an AMX CPU")
            flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
        stamp = self.cache / "build_flags.txt"  # a build made with other flags is built again
        if all((self.bin / t).exists() for t in TARGETS) and stamp.exists() and stamp.read_text() == " ".join(flags):
            return
        cmake, ninja = self._cmake()
        build = self.cache / "build"
        gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        self.log(
            f"llama.cpp: building {', '.join(TARGETS)} with -j{self.jobs} (minutes; log in {self.cache}/build.log)"
        )
        started = time.perf_counter()
        _run([cmake, "-S", self.source, "-B", build, *gen, *flags], self.cache / "configure.log")
        _run([cmake, "--build", build, f"-j{self.jobs}", "--target", *TARGETS], self.cache / "build.log")
        seconds = time.perf_counter() - started
        (self.cache / "build_seconds.txt").write_text(f"{seconds:.0f}\n")
        stamp.write_text(" ".join(flags))
        self.log(f"llama.cpp: built in {seconds:.0f} s")

    def build_seconds(self) -> float | None:
        path = self.cache / "build_seconds.txt"
        return float(path.read_text()) if path.exists() else None

    def version(self) -> str:
        proc = subprocess.run([str(self.bin / "llama-completion"), "--version"], capture_output=True, text=True)
        found = re.search(r"version: (.*)", proc.stdout + proc.stderr)
        return found.group(1).strip() if found else "unknown"

    def patch_converter(self) -> None:
        """The converter knows a tokenizer by a hash of its tokens for a test string and stops on one it
        does not list; patched (the cached copy), it takes the name from SPECINFER_TOKENIZER_PRE instead."""
        base = self.source / "conversion" / "base.py"
        text = base.read_text()
        if PATCH_MARK in text:
            return
        if PATCH_ANCHOR not in text:
            raise SystemExit(f"{base}: get_vocab_base_pre's 'if res is None' not found; update PATCH_ANCHOR")
        base.write_text(text.replace(PATCH_ANCHOR, PATCH + PATCH_ANCHOR, 1))

    def converter_python(self) -> Path:
        """A venv for the converter: sentencepiece (which it imports) installed there, torch,
        transformers, numpy and safetensors read from this interpreter's site-packages (a .pth)."""
        venv = self.cache / "convert-venv"
        python = venv / "bin" / "python"
        done = venv / ".specinfer-ready"
        if not done.exists():
            _run([sys.executable, "-m", "venv", "--clear", venv])
            site = next(venv.glob("lib/python*/site-packages"))
            (site / "specinfer_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
            _run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "sentencepiece"])
            done.write_text("")
        return python

    def stage(self, model_dir: Path) -> Path:
        """``model_dir`` as the converter should see it: its files linked, and a tokenizer_config.json
        saying whether a prompt gets BOS/EOS (the GGUF's add_bos/add_eos, so llama.cpp encodes as we do)."""
        key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:12]
        stage = self.cache / "stage" / f"{model_dir.name}-{key}"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        for f in model_dir.iterdir():
            if f.is_file() and f.name != "tokenizer_config.json":
                (stage / f.name).symlink_to(f.resolve())
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        config["add_bos_token"], config["add_eos_token"] = special_tokens_added(model_dir)
        (stage / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return stage

    def convert(self, model_dir: Path, dtype: str) -> Path:
        """The GGUF of ``model_dir`` in ``dtype`` (converted once per folder, mtimes, dtype and pin)."""
        model_dir = model_dir.resolve()
        mtimes = sorted((f.name, f.stat().st_mtime_ns) for f in model_dir.iterdir() if f.is_file())
        key = hashlib.sha256(json.dumps([str(model_dir), mtimes, dtype, PIN]).encode()).hexdigest()[:16]
        out = self.cache / "gguf" / f"{model_dir.name}-{GGUF_TYPES[dtype]}-{key}.gguf"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "SPECINFER_TOKENIZER_PRE": pre_tokenizer(model_dir)}
        env.pop("NO_LOCAL_GGUF", None)  # the sdist's gguf-py, not any installed gguf
        tmp = out.with_suffix(".partial")
        self.log(f"llama.cpp: converting {model_dir} to {out.name}")
        cmd = [self.converter_python(), self.source / "convert_hf_to_gguf.py", self.stage(model_dir)]
        _run([*cmd, "--outtype", GGUF_TYPES[dtype], "--outfile", tmp], self.cache / "gguf" / f"{out.stem}.log", env=env)
        tmp.rename(out)
        return out

    def _run_parsed(self, cmd: list, parse, attempts: int = 3):
        """Run and parse, again when parsing fails: llama.cpp's log thread is never joined, so a process
        can exit before its last lines (timings, the text's end) are written (common/log.cpp)."""
        for attempt in range(attempts):
            proc = _run(cmd, timeout=3600)
            try:
                return parse(proc)
            except ValueError as e:
                failed = self.cache / "failed-output.txt"
                failed.write_text(f"$ {' '.join(map(str, cmd))}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
                self.log(f"llama.cpp: {e} (attempt {attempt + 1} of {attempts}; output in {failed})")
        raise RuntimeError(f"{Path(str(cmd[0])).name}: no complete output in {attempts} runs")

    def completion(self, gguf: Path, prompt: str, n: int, threads: int, ctx: int) -> dict:
        """llama.cpp incremental, greedy: the generated text and its decode timing. The prompt goes in
        as -p with --no-escape (-f drops a final newline, escapes would rewrite backslashes)."""
        cmd = [self.bin / "llama-completion", "-m", gguf, "-p", prompt, "--no-escape", "-n", n, "-c", ctx]
        cmd += ["-t", threads, "-tb", threads, "--temp", "0", "--seed", "0", "-no-cnv", "--no-display-prompt"]
        (runs, seconds), text = self._run_parsed(cmd, lambda p: (parse_completion(p.stderr), completion_text(p.stdout)))
        return {"decode_tokens": runs, "decode_seconds": seconds, "tokens": runs + 1, "steps": runs + 1, "text": text}

    def speculative(
        self, ggufs: tuple[Path, Path], prompt: str, n: int, threads: int, ctx: int, draft: int, p_min: float
    ):
        """llama.cpp speculative decoding with the SSM as draft model (draft-simple), greedy."""
        cmd = [self.bin / "llama-speculative-simple", "-m", ggufs[0], "-md", ggufs[1], "-p", prompt, "--no-escape"]
        cmd += ["-n", n, "-c", ctx, "-t", threads, "-tb", threads, "-td", threads, "--temp", "0", "--seed", "0"]
        cmd += ["--spec-type", "draft-simple", "--spec-draft-n-max", draft, "--spec-draft-n-min", 0]
        cmd += ["--spec-draft-p-min", p_min]
        stats, text = self._run_parsed(cmd, lambda p: (parse_speculative(p.stderr), speculative_text(p.stdout, prompt)))
        return {
            "decode_tokens": stats["decoded"],
            "decode_seconds": stats["seconds"],
            "tokens": stats["decoded"],
            "steps": stats["n_predict"] - stats["n_accept"],  # one target decode per draft (no checkpoints)
            "text": text,
            "n_drafted": stats.get("n_drafted"),
            "n_accept": stats.get("n_accept"),
        }

    def bench(self, gguf: Path, n: int, threads: int) -> dict:
        """``llama-bench -p 0 -n N``: token generation from an empty context (a reference row, no text)."""
        proc = _run(
            [self.bin / "llama-bench", "-m", gguf, "-p", 0, "-n", n, "-t", threads, "-r", 3, "-o", "json"], timeout=3600
        )
        tps = parse_bench(proc.stdout)
        return {
            "system": "llama.cpp",
            "setting": f"llama-bench tg{n} (empty context, 3 repeats)",
            "prompts": 0,
            "tokens_per_second": round(tps, 3),
            "tokens_per_step": 1.0,
        }


def completion_text(stdout: str) -> str:
    """The generated text of ``llama-completion --no-display-prompt``: it ends with " [end of text]"
    at EOS, then two newlines (ValueError without them: output lost)."""
    if not stdout.endswith("\n\n"):
        raise ValueError("llama-completion's output does not end with its two newlines")
    body = stdout[:-2]
    return body[: -len(" [end of text]\n")] if body.endswith(" [end of text]\n") else body


def speculative_text(stdout: str, prompt: str) -> str:
    """The generated text of ``llama-speculative-simple``: two newlines, the prompt's tokens, the new
    ones, then two newlines twice (ValueError without them: output lost)."""
    if not stdout.endswith("\n\n\n\n"):
        raise ValueError("llama-speculative-simple's output does not end with its four newlines")
    body = stdout[2:-4] if stdout.startswith("\n\n") else stdout[:-4]
    return body[len(prompt) :] if body.startswith(prompt) else body
