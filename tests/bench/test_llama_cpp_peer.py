"""bench/peers/llama_cpp.py without building llama.cpp: flags, parsing of what llama.cpp's programs
print (real lines, captured from the pinned build: llama-cpp-python 0.3.36, llama.cpp 0c1e570, on the
demo pair), the table and its ratios, the converter's patch and the GGUF cache."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "bench/peers"


def _load(name: str, alias: str):
    sys.path.insert(0, str(PEERS))
    try:
        spec = importlib.util.spec_from_file_location(alias, PEERS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[alias] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PEERS))


tools = _load("llama_cpp_tools", "llama_cpp_tools")  # the name llama_cpp.py imports it by
peer = _load("llama_cpp", "peer_llama_cpp")  # not "llama_cpp", the name of llama-cpp-python's package

# llama-completion -p "def fibonacci(n):\n" --no-escape -n 16 -t 2 --temp 0 -no-cnv --no-display-prompt
COMPLETION_STDERR = (
    "0.00.023.962 I generate: n_ctx = 1024, n_batch = 2048, n_predict = 16, n_keep = 0\n"
    "0.00.628.899 I common_perf_print:    sampling time =       0.50 ms\n"
    "0.00.628.918 I common_perf_print:    samplers time =       0.19 ms /    26 tokens\n"
    "0.00.628.926 I common_perf_print:        load time =     452.51 ms\n"
    "0.00.628.932 I common_perf_print: prompt eval time =     452.26 ms /    10 tokens "
    "(   45.23 ms per token,    22.11 tokens per second)\n"
    "0.00.628.937 I common_perf_print:        eval time =     151.18 ms /    15 runs   "
    "(   10.08 ms per token,    99.22 tokens per second)\n"
    "0.00.628.942 I common_perf_print:       total time =     605.17 ms /    25 tokens\n"
    "0.00.628.947 I common_perf_print: unaccounted time =       1.23 ms /   0.2 %      "
    "(total - sampling - prompt eval - eval) / (total)\n"
    "0.00.628.952 I common_perf_print:    graphs reused =         14\n"
)
COMPLETION_STDOUT = "\ndef _go_from_from_from_from_from_\n\n"

# llama-speculative-simple (same prompt) -md ssm.gguf --spec-type draft-simple --spec-draft-n-max 8 -n 16
SPECULATIVE_STDERR = (
    "0.00.028.552 I cmn          init: llama threadpool init, n_threads = 2\n"
    "0.00.514.731 I common_speculative_init_result: loading draft"
    " model 'gguf/ssm-bf16-3f7030340180acf9.gguf'\n"
    "0.07.522.105 I encoded   10 tokens in    0.600 seconds, speed:   16.659 t/s\n"
    "0.07.522.561 I decoded   25 tokens in    6.319 seconds, speed:    3.956 t/s\n"
    "0.07.522.566 I \n"
    "0.07.522.571 I n_draft   = 8\n"
    "0.07.522.576 I n_predict = 25\n"
    "0.07.522.580 I n_drafted = 48\n"
    "0.07.522.585 I n_accept  = 19\n"
    "0.07.522.731 I accept    = 39.583%\n"
    "0.07.523.950 I common_perf_print: prompt eval time =    3686.02 ms /    65 tokens "
    "(   56.71 ms per token,    17.63 tokens per second)\n"
    "0.07.523.956 I common_perf_print:        eval time =       0.00 ms /     1 runs   "
    "(    0.00 ms per token,      inf tokens per second)\n"
)
SPECULATIVE_STDOUT = "\n\ndef fibonacci(n):\n\ndef _go_from_from_from_from_from_from_from_from_from_from\n\n\n\n"

# llama-bench -p 0 -n 16 -t 2 -r 3 -o json (fields shortened)
BENCH_STDOUT = """[
  {
    "build_commit": "0c1e570",
    "model_type": "llama ?B BF16",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 16,
    "avg_ns": 6038348,
    "stddev_ns": 364755,
    "avg_ts": 2656.310537,
    "stddev_ts": 163.453186,
    "samples_ts": [ 2514.81, 2618.89, 2835.23 ]
  }
]
"""


def test_flags_defaults_and_sweeps():
    args = peer.parse_args([])
    assert (args.new_tokens, args.threads, args.dtype, args.count) == (64, 2, "bfloat16", 5)
    assert args.draft_max == [4, 8, 16] and args.draft_p_min == [0.0, 0.5]
    assert args.cache == Path.home() / ".cache/specinfer/peers/llama_cpp"
    assert REPO not in args.cache.parents
    args = peer.parse_args(["--draft-max", "2,6", "--draft-p-min", "0.25", "--dtype", "float32", "--threads", "1"])
    assert args.draft_max == [2, 6] and args.draft_p_min == [0.25] and args.dtype == "float32"
    cases = peer.llama_cases(args)
    assert cases[0] == (peer.INCREMENTAL[1], 0, 0.0)
    assert [c[1:] for c in cases[1:]] == [(2, 0.25), (6, 0.25)]
    with pytest.raises(SystemExit):
        peer.parse_args(["--new-tokens", "0"])
    with pytest.raises(SystemExit):
        peer.parse_args(["--dtype", "float16"])


def test_flags_without_ssm_a_gguf_and_our_quantization(tmp_path):
    """``--ssm none``: llama.cpp incremental only, ours incremental and auto; ``--gguf`` names llama.cpp's file;
    ``--quantize`` is ours in this process only."""
    ours = _load("ours", "ours")
    args = peer.parse_args(["--ssm", "none", "--gguf", str(tmp_path / "m.gguf"), "--quantize", "int4"])
    assert args.ssm is None and args.gguf == tmp_path / "m.gguf" and args.quantize == "int4"
    assert peer.llama_cases(args) == [(peer.INCREMENTAL[1], 0, 0.0)]
    assert [m.kind for m in ours.methods(["1,1,3", "tuned"], None)] == ["incremental", "auto"]
    assert peer.parse_args([]).ssm == REPO / "models/demo/ssm" and peer.parse_args([]).quantize == "none"
    with pytest.raises(SystemExit):
        peer.parse_args(["--quantize", "int8", "--through-services"])
    with pytest.raises(SystemExit):
        peer.parse_args(["--quantize", "int2"])


def test_prompts_read_prompt_or_text(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a\n"}) + "\n\n" + json.dumps({"id": "x", "text": "b"}) + "\n")
    assert peer.load_prompts(path, 5) == ["a\n", "b"]
    assert peer.load_prompts(path, 1) == ["a\n"]


def test_parse_completion_takes_eval_not_prompt_eval():
    assert tools.parse_completion(COMPLETION_STDERR) == (15, pytest.approx(0.15118))
    with pytest.raises(ValueError):
        tools.parse_completion(COMPLETION_STDERR.replace("       eval time", "  lost"))


def test_parse_speculative_counts():
    stats = tools.parse_speculative(SPECULATIVE_STDERR)
    assert stats == {"decoded": 25, "seconds": 6.319, "n_draft": 8, "n_predict": 25, "n_drafted": 48, "n_accept": 19}
    # lines lost at exit (llama.cpp's log thread is not joined): an error, so the run is repeated
    with pytest.raises(ValueError):
        tools.parse_speculative(SPECULATIVE_STDERR.split("n_accept")[0])
    with pytest.raises(ValueError):
        tools.parse_speculative(COMPLETION_STDERR)


def test_parse_bench():
    assert tools.parse_bench(BENCH_STDOUT) == pytest.approx(2656.310537)


def test_generated_text_of_each_program():
    assert tools.completion_text(COMPLETION_STDOUT) == "\ndef _go_from_from_from_from_from_"
    assert tools.completion_text("\n    return x [end of text]\n\n\n") == "\n    return x"
    prompt = "def fibonacci(n):\n"
    assert tools.speculative_text(SPECULATIVE_STDOUT, prompt) == "\ndef _go" + "_from" * 10
    with pytest.raises(ValueError):
        tools.completion_text(COMPLETION_STDOUT[:-1])
    with pytest.raises(ValueError):
        tools.speculative_text(SPECULATIVE_STDOUT[:-2], prompt)
    assert peer.same_text("\ndef _go_from", "\ndef _go_from_from") and not peer.same_text("\ndef _go", "\n#")


def _sample(tokens: int, seconds: float, steps: int | None, text: str, drafted: int = 0) -> dict:
    sample = {"decode_tokens": tokens - 1, "decode_seconds": seconds, "tokens": tokens, "steps": steps, "text": text}
    return sample | ({"n_drafted": drafted, "n_accept": tokens - steps} if drafted else {})


def test_table_ratios_and_greedy_agreement():
    spec4 = [_sample(21, 0.5, 7, "abX", 24), _sample(17, 0.3, 6, "cd", 20)]  # 25 of 44 drafted tokens accepted
    samples = {
        peer.INCREMENTAL: [_sample(17, 1.6, 17, "ab"), _sample(17, 1.6, 17, "cd")],
        ("llama.cpp", "speculative draft-max 4 p-min 0"): spec4,
        ("llama.cpp", "speculative draft-max 8 p-min 0"): [_sample(21, 0.8, 5, "ab"), _sample(17, 0.8, 5, "cd")],
        ("specinfer", "auto (adaptive)"): [_sample(17, 0.4, 6, "ab"), _sample(17, 0.4, 6, "ce")],
    }
    bench = {"system": "llama.cpp", "setting": "llama-bench tg16", "prompts": 0, "tokens_per_second": 40.0}
    bench["tokens_per_step"] = 1.0
    rows = {(r["system"], r["setting"]): r for r in peer.summarise(samples, bench)}
    inc, best = rows[peer.INCREMENTAL], rows[("llama.cpp", "speculative draft-max 4 p-min 0")]
    assert inc["tokens_per_second"] == 10.0 and inc["tokens_per_step"] == 1.0
    assert best["tokens_per_second"] == 45.0 and best["tokens_per_step"] == pytest.approx(38 / 13, abs=1e-3)
    assert best["best_llama_cpp_speculative"] and best["draft_acceptance"] == pytest.approx(25 / 44, abs=1e-3)
    assert "draft_acceptance" not in inc
    assert not rows[("llama.cpp", "speculative draft-max 8 p-min 0")]["best_llama_cpp_speculative"]
    ours = rows[("specinfer", "auto (adaptive)")]
    assert ours["tokens_per_second"] == 40.0
    assert ours["vs_llama_cpp_best_speculative"] == pytest.approx(40 / 45, abs=1e-3)
    assert ours["vs_llama_cpp_incremental"] == 4.0
    assert ours["greedy_text_equals_llama_cpp"] == "1/2" and best["greedy_text_equals_llama_cpp"] == "2/2"
    assert "greedy_text_equals_llama_cpp" not in inc
    assert rows[("llama.cpp", "llama-bench tg16")]["vs_llama_cpp_incremental"] == 4.0
    table = peer.markdown(peer.summarise(samples, bench)).splitlines()
    assert len(table) == 2 + 5 and table[0].startswith("| system | setting | tokens/s |")
    assert "| llama.cpp | speculative draft-max 4 p-min 0 **(best)** | 45.0 | 2.92 | 1.00 | 4.50 | 2/2 |" in table
    assert "| specinfer | auto (adaptive) | 40.0 | 2.83 | 0.89 | 4.00 | 1/2 |" in table


def test_rows_without_decode_tokens_have_no_rate():
    samples = {peer.INCREMENTAL: [_sample(1, 0.0, 1, "a")], ("specinfer", "tree <1,1>"): [_sample(1, 0.0, 1, "a")]}
    rows = peer.summarise(samples)
    assert all(r["tokens_per_second"] is None and r["vs_llama_cpp_incremental"] is None for r in rows)
    assert "| specinfer | tree <1,1> | - | 1.00 | - | - | 1/1 |" in peer.markdown(rows)


def test_demo_tokenizer_is_gpt2_byte_level_without_bos(tmp_path):
    demo = REPO / "models/demo/llm"
    assert tools.pre_tokenizer(demo) == "gpt-2"
    assert tools.special_tokens_added(demo) == (False, False)
    tok = json.loads((demo / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SystemExit):
        tools.pre_tokenizer(tmp_path)


def test_converter_patch_is_applied_once(tmp_path):
    toolchain = tools.Toolchain(tmp_path / "cache", log=lambda *_: None)
    base = toolchain.source / "conversion" / "base.py"
    base.parent.mkdir(parents=True)
    original = "        res = None\n" + tools.PATCH_ANCHOR + "            raise NotImplementedError()\n"
    base.write_text(original)
    toolchain.patch_converter()
    toolchain.patch_converter()
    patched = base.read_text()
    assert patched.count(tools.PATCH_MARK) == 1 and patched.index(tools.PATCH_MARK) < patched.index("if res is None:")
    base.write_text("unrelated\n")
    with pytest.raises(SystemExit):
        toolchain.patch_converter()


def test_gguf_cache_keyed_by_folder_mtime_and_dtype(tmp_path, monkeypatch):
    model = tmp_path / "llm"
    model.mkdir()
    shutil.copy(REPO / "models/demo/llm/tokenizer.json", model / "tokenizer.json")
    (model / "config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    calls = []

    def fake_run(cmd, log=None, env=None, **kw):
        calls.append([str(c) for c in cmd])
        assert env["SPECINFER_TOKENIZER_PRE"] == "gpt-2"
        Path(cmd[cmd.index("--outfile") + 1]).write_bytes(b"GGUF")

    monkeypatch.setattr(tools, "_run", fake_run)
    toolchain = tools.Toolchain(tmp_path / "cache", log=lambda *_: None)
    monkeypatch.setattr(toolchain, "converter_python", lambda: Path("python"))
    first = toolchain.convert(model, "bfloat16")
    assert first.read_bytes() == b"GGUF" and len(calls) == 1 and calls[0][calls[0].index("--outtype") + 1] == "bf16"
    staged = Path(calls[0][2])
    assert json.loads((staged / "tokenizer_config.json").read_text())["add_bos_token"] is False
    assert (staged / "tokenizer.json").resolve() == (model / "tokenizer.json").resolve()
    assert toolchain.convert(model, "bfloat16") == first and len(calls) == 1
    assert toolchain.convert(model, "float32") != first and len(calls) == 2
    os.utime(model / "config.json", ns=(1, 1))
    assert toolchain.convert(model, "bfloat16") != first and len(calls) == 3


@pytest.mark.parametrize("amx", [False, True])
def test_the_build_leaves_out_amx_where_the_cpu_has_it_and_rebuilds_when_its_flags_change(tmp_path, monkeypatch, amx):
    """llama.cpp's AMX kernels stop with SIGILL on the AMX VM we met: built without them there; a build whose flags
    differ from the ones recorded beside it is built again, one with the same flags is kept."""
    calls = []
    monkeypatch.setattr(tools, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(tools, "_run", lambda cmd, *a, **kw: calls.append([str(c) for c in cmd]))
    chain = tools.Toolchain(tmp_path, log=lambda *_: None)
    monkeypatch.setattr(chain, "_cmake", lambda: ("cmake", ""))
    chain.bin.mkdir(parents=True)
    for target in tools.TARGETS:
        (chain.bin / target).write_text("")  # a build without a record of its flags (an older harness's)
    chain.build()
    configure = calls[0]
    assert configure[:2] == ["cmake", "-S"] and ("-DCMAKE_C_FLAGS=" + tools.NO_AMX in configure) == amx
    assert ("-DCMAKE_CXX_FLAGS=" + tools.NO_AMX in configure) == amx
    chain.build()  # the same flags: kept
    assert len(calls) == 2  # configure and build, once
    monkeypatch.setattr(tools, "cpu_has_amx", lambda: not amx)
    chain.build()
    assert len(calls) == 4
