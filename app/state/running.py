"""What actually runs: the loaded pair described from the loaded model, not from the settings.

The settings say what the user asked for ("Quantisation: none", "Mode: speculative"); what
runs can differ: a GGUF keeps its own blocks, a CPU computes in FP32, a pair without a draft
decodes draft-free, the draft switches itself off where it is slower. `RunningPair` is built
when a load finishes (main_window, from the worker's `loaded` signal: the paths loaded and the
engine's Placement) and shown by Settings -> Engine and the models page.

Plain data, no widgets and no tensors: the GGUF's type comes from its header, the decoding mode
from the same rule the engine applies (engine.decoding.generation: a draft and mode "specexec"
-> draft trees; no draft -> draft-free context trees; "autoregressive" -> one token per pass),
and the last answer's mode from the measured speeds (engine.planning.measured). What the API
server can do with the model (tools, JSON output, reasoning: `api_support`) comes from its chat
template by the server's own rules (engine.serving.formats and tools), so Settings > Server says
what the server then does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.planning.measured import MeasuredSpeed, SpeedKey, measured_speed, speed_key
from engine.serving.formats import GRAMMAR_FORMATS, chat_format
from engine.serving.tools import ToolError, check_template
from engine.shapes import Placement
from engine.store.pypi import STARTER_FORMAT, built_starter

MODE_WORDS = {"specexec": "SpecExec trees from the draft", "context": "draft-free (text from the context)",
              "autoregressive": "one token per pass"}


@dataclass(frozen=True)
class RunningPair:
    """The loaded pair: paths as loaded ("" = no draft), where and how its layers run, the
    decoding mode the settings lead to, its measured-speed key and the target's chat template
    ("" without one)."""

    target: str
    draft: str
    placement: Placement | None
    fmt: str  # "FP32", "GGUF Q4_1", ... (engine.planning.measured.run_format)
    tree_mode: str = "specexec"
    keep_draft: bool = False
    auto_off: str = ""  # why budget "auto" leaves the draft out (its latest choice); "" while it uses it
    chat_template: str = field(default="", repr=False)

    @property
    def key(self) -> SpeedKey:
        return speed_key(self.target, self.draft or None, self.placement)

    @property
    def name(self) -> str:
        return Path(self.target).name or self.target

    def format_text(self) -> str:
        """"Q4_1 GGUF, as shipped: its blocks multiplied by the packed CPU kernel" (the starter) /
        "GGUF Q4_1 blocks, de-quantised as each layer runs, on the GPU" / "BF16 on the GPU"."""
        where = "on the GPU" if self.placement is not None and self.placement.device.startswith("cuda") else "on the CPU"
        form = self.placement.resident_form if self.placement is not None else ""
        how = {"kernel": "multiplied by the packed CPU kernel", "dequantised": "de-quantised once, at load"}.get(
            form, "de-quantised as each layer runs")
        starter = built_starter()
        if starter is not None and _same(starter, self.target):
            return f"{STARTER_FORMAT}: its blocks {how}, {where}"
        if self.fmt.startswith("GGUF"):
            return f"{self.fmt} blocks, {how}, {where}"
        return f"{self.fmt} {where}"

    def decoding_text(self, measured: MeasuredSpeed | None = None) -> str:
        """The decoding mode that runs, and the one the last answer measured when it differed."""
        if self.tree_mode == "autoregressive":
            text = "plain decoding, one token per pass"
        elif not self.draft:
            text = "draft-free: no draft model; text copied from the context is checked, several tokens per pass " \
                   "where it repeats"
        elif self.auto_off:
            text = f"draft-free: budget auto leaves the draft out on this computer ({self.auto_off})"
        else:
            text = "SpecExec trees from the draft" + ("" if self.keep_draft else
                                                       "; the draft is turned off while it is measured slower")
        nominal = ("autoregressive" if self.tree_mode == "autoregressive"
                   else "specexec" if self.draft and not self.auto_off else "context")
        if measured is not None and measured.last_mode in MODE_WORDS and measured.last_mode != nominal:
            text += f" (the last answer: {MODE_WORDS[measured.last_mode]})"
        return text

    def measured(self) -> MeasuredSpeed | None:
        key = self.key
        return measured_speed(key.target, key.draft or None, key.device, key.fmt)

    def summary(self, sep: str = " · ") -> str:
        """Model, format, where the layers live, decoding, measured speed, joined by `sep`."""
        measured = self.measured()
        parts = [f"<b>{self.name}</b>" + (f" + draft <b>{Path(self.draft).name}</b>" if self.draft else ", no draft"),
                 self.format_text()]
        if self.placement is not None:
            parts.append(self.placement.describe())
        parts.append(f"decoding: {self.decoding_text(measured)}")
        parts.append(measured.describe() if measured is not None else "not measured here yet")
        return sep.join(parts)


def running_pair(target: str, draft: str, placement: Placement | None, tree_mode: str = "specexec",
                 keep_draft: bool = False, chat_template: str = "") -> RunningPair:
    """Describe a pair the worker has just loaded (its `loaded` signal's paths, Placement and
    chat template)."""
    from engine.planning.measured import run_format

    return RunningPair(target, draft, placement, run_format(target, placement), tree_mode, keep_draft,
                       chat_template=chat_template)


TOOL_FORMATS = {"hermes": "Hermes/Qwen <tool_call> JSON", "llama3": "Llama 3 JSON",
                "mistral": "Mistral [TOOL_CALLS]", "harmony": "gpt-oss harmony", "gemma4": "Gemma 4 <|tool_call>"}
REASONING_FORMATS = {"think": "<think> blocks", "harmony": "the harmony analysis channel",
                     "gemma4": "Gemma 4's thought channel"}
JSON_OUTPUT = ("yes: response_format json_object / json_schema answers are decoded under the schema "
               "(grammar-constrained, as the model alone would answer under it)")


@dataclass(frozen=True)
class ApiSupport:
    """What the API server does with a model's answers, in sentences: `tools` whether requests
    may carry tools (as engine.serving.tools decides), and a line each for tools, JSON output
    and reasoning."""

    tools: bool
    tools_text: str
    json_text: str
    reasoning_text: str


def api_support(chat_template: str) -> ApiSupport:
    """What the API server does with a model whose chat template is `chat_template` ("": unknown)."""
    fmt = chat_format(chat_template)
    try:
        check_template(fmt, bool(chat_template), "tools")
    except ToolError as exc:
        tools, tools_text = False, f"no. {exc.message}"
    else:
        assert fmt.tools is not None
        forced = ("tool_choice auto, none, required or a named function (forced calls are decoded under "
                  "a grammar)" if fmt.tools in GRAMMAR_FORMATS else
                  "tool_choice auto or none; required or a named function is not available for this format yet")
        tools, tools_text = True, f"yes: calls written as {TOOL_FORMATS[fmt.tools]} come back as tool_calls ({forced})"
    reasoning = (f"{REASONING_FORMATS[fmt.reasoning]} come back as reasoning_content, apart from the answer"
                 if fmt.reasoning is not None else "none in this model's format: answers are content only")
    if fmt.reasoning == "harmony":
        reasoning = reasoning.replace("come back", "comes back")
    json_text = JSON_OUTPUT
    return ApiSupport(tools, tools_text, json_text, reasoning)


def _same(a: Path, b: str) -> bool:
    try:
        return a.resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError):
        return False
