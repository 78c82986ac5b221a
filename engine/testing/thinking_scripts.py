"""The scripts of the two scripted thinking models (scripted_model.py): a Qwen 3 thinking model
(its generation prompt opens <think>; the answer closes it, then answers) and a gpt-oss model in
the harmony format (an analysis message, then a final one). Each Script holds the reasoning and
the answer a parser must read from it.

The two say different things, so a test cannot pass on the other model's answer.

HARMONY is a harmony chat template written for these tests after the format gpt-oss's own
template renders (system message with the reasoning effort, a developer message with the
instructions and the tools as a TypeScript namespace, assistant calls on the commentary channel,
tool results from `functions.NAME`, the generation prompt `<|start|>assistant`). The Qwen 3
template is the test suite's (tests/engine/serving/templates.py), passed in by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.testing.scripted_model import Script, cached_scripted_model

_THINK_REASONING = ("The", " user", " says", " hello.", " A", " short,", " friendly", " greeting", " fits;",
                    " I", " should", " also", " offer", " help.")
_THINK_ANSWER = ("Hello!", " How", " can", " I help", " you", " today?")
_HARMONY_REASONING = ("The", " user", " greets", " me.", " Reply", " warmly", " and", " briefly,", " then", " ask",
                      " what", " they", " need.")
_HARMONY_ANSWER = ("Hi!", " What", " can", " I", " do", " for", " you?")

HARMONY = """{%- set effort = reasoning_effort if reasoning_effort is defined else "medium" -%}
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: {{ effort }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{{- "\nCalls to these tools must go to the commentary channel: 'functions'." if tools }}<|end|>
{%- set instructions = messages[0].content if messages and messages[0].role in ("system", "developer") else "" %}
{%- if instructions or tools %}<|start|>developer<|message|>
{%- if instructions %}# Instructions

{{ instructions }}
{%- endif %}
{%- if tools %}
{{- "\n\n" if instructions }}# Tools

## functions

namespace functions {
{% for tool in tools %}
{%- set f = tool.function if tool.function is defined else tool %}
// {{ f.description }}
type {{ f.name }} = (_: {{ f.parameters | tojson }}) => any;

{% endfor %}
} // namespace functions
{%- endif %}<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == "assistant" and message.tool_calls %}
{%- if message.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ message.reasoning_content }}<|end|>
{%- endif %}
{%- for call in message.tool_calls %}
{%- set f = call.function if call.function is defined else call %}<|start|>assistant<|channel|>commentary to=functions.{{ f.name }} <|constrain|>json<|message|>{{ f.arguments if f.arguments is string else f.arguments | tojson }}<|call|>
{%- endfor %}
{%- elif message.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- elif message.role == "tool" %}<|start|>functions.{{ message.name if message.name is defined else "tool" }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def think_script(template: str) -> Script:
    """Qwen 3 thinking under `template` (its generation prompt must open <think>): the answer is
    the reasoning, </think>, a blank line, the answer, <|im_end|>."""
    return Script(name="qwen3-thinking", template=template, reasoning="".join(_THINK_REASONING),
                  answer="".join(_THINK_ANSWER),
                  pieces=(*_THINK_REASONING[:-1], " help.\n", "</think>", "\n\nHello!", *_THINK_ANSWER[1:]),
                  specials=("<|im_start|>", "<|im_end|>"), eos="<|im_end|>")


def harmony_script() -> Script:
    """gpt-oss: `<|channel|>analysis<|message|>` REASONING, then `<|end|><|start|>assistant
    <|channel|>final<|message|>` (one token: its markers already came once) ANSWER, <|return|>.
    The first message's markers are the tokenizer's special tokens, as in gpt-oss."""
    final = "<|end|><|start|>assistant<|channel|>final<|message|>"
    return Script(name="gpt-oss-harmony", template=HARMONY, reasoning="".join(_HARMONY_REASONING),
                  answer="".join(_HARMONY_ANSWER),
                  pieces=("<|channel|>", "analysis", "<|message|>", *_HARMONY_REASONING, final, *_HARMONY_ANSWER),
                  specials=HARMONY_SPECIALS, eos="<|return|>", stops=("<|call|>",))


DRAFT_NOISE = 0.07  # the draft agrees with the script on about two pieces in three: trees get rejected


@dataclass(frozen=True)
class ScriptedPair:
    """A scripted model, its script, and a noisy copy of it (same tokenizer) to serve as its draft."""

    script: Script
    target: Path
    draft: Path


def scripted_thinking_models(cache_dir: Path, qwen_template: str) -> dict[str, ScriptedPair]:
    """Both thinking models, by script name, built once under `cache_dir`."""
    pairs = {}
    for script in (think_script(qwen_template), harmony_script()):
        pairs[script.name] = ScriptedPair(script, cached_scripted_model(script, cache_dir),
                                          cached_scripted_model(script, cache_dir, noise=DRAFT_NOISE))
    return pairs
