"""Answers split into content, reasoning and tool calls, in each model family's own format
(engine.serving.formats), on scripted answer texts: the whole answer, and the same answer fed
in every kind of split, whose deltas must put back together to exactly the whole answer's
result. Text that could start a marker is held back; a call that does not parse stays prose."""

from __future__ import annotations

import json
import random

import pytest
from templates import CHATML, GEMMA4, HARMONY, LLAMA3, MISTRAL, QWEN, QWEN_THINKING

from engine.serving.formats import ChatFormat, OutputParser, OutputSettings, ParsedOutput, chat_format

HERMES = chat_format(QWEN)
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
Q = '<|"|>'  # Gemma 4's string delimiter


def test_the_format_comes_from_the_template() -> None:
    assert HERMES == ChatFormat("hermes", True, "think", False)
    assert QWEN_THINKING != QWEN and chat_format(QWEN_THINKING) == ChatFormat("hermes", True, "think", True)
    assert chat_format(LLAMA3) == ChatFormat("llama3", True)
    assert chat_format(MISTRAL) == ChatFormat("mistral", True)
    assert chat_format(HARMONY) == ChatFormat("harmony", True, "harmony")
    assert chat_format(GEMMA4) == ChatFormat("gemma4", True, "gemma4")
    assert chat_format(CHATML) == ChatFormat() and chat_format("") == ChatFormat()
    assert chat_format("{{ tools | tojson }}") == ChatFormat(None, True)  # takes tools in a format not read here
    assert chat_format(MISTRAL).call_id().isalnum() and len(chat_format(MISTRAL).call_id()) == 9
    assert HERMES.call_id().startswith("call_") and HERMES.call_id() != HERMES.call_id()


def streamed(settings: OutputSettings, pieces: list[str]) -> tuple[ParsedOutput, ParsedOutput]:
    """(the deltas put back together, the parser's own result) for an answer fed in `pieces`."""
    parser = settings.parser()
    content, reasoning, calls = "", "", []
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        assert delta.call_index == len(calls)
        content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + list(delta.calls)
    return ParsedOutput(content or None, reasoning or None, tuple(calls)), parser.result()


def splits(text: str, rng: random.Random) -> list[list[str]]:
    """The text whole, one character at a time, and random cuts."""
    out = [[text], list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def plain(result: ParsedOutput) -> tuple[str | None, str | None, list[tuple[str, dict]]]:
    """A result without its random call ids."""
    return result.content, result.reasoning, [(c.name, json.loads(c.arguments)) for c in result.calls]


CASES = [  # (format, tools read, answer, (content, reasoning, [(name, arguments)]))
    (HERMES, True, f"<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
     ("Let me check.", "The user wants weather.", [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    (HERMES, True, f'<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n'
                   "</tool_call>",
     (None, None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})])),
    (HERMES, True, "Just prose, with a < and a <tool and a <think> late.\n",
     ("Just prose, with a < and a <tool and a <think> late.", None, [])),
    (HERMES, True, "<tool_call>\nnot json\n</tool_call> after",
     ("<tool_call>\nnot json\n</tool_call> after", None, [])),
    (HERMES, True, f"<tool_call>\n{WEATHER}",  # cut before its end tag: read at the answer's end
     (None, None, [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    (HERMES, True, '<tool_call>{"name": "bad name!", "arguments": {}}</tool_call>',
     ('<tool_call>{"name": "bad name!", "arguments": {}}</tool_call>', None, [])),
    (HERMES, True, '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
     (None, None, [("f", {"a": [1, 2]})])),
    (HERMES, False, f"<think>Hmm.</think>Answer <tool_call>{WEATHER}</tool_call>",  # tool_choice none
     (f"Answer <tool_call>{WEATHER}</tool_call>", "Hmm.", [])),
    (chat_format(QWEN_THINKING), True, "Thinking already.\n</think>\n\nThe answer.",
     ("The answer.", "Thinking already.", [])),
    (chat_format(LLAMA3), True, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
     (None, None, [("f", {"x": 1}), ("g", {})])),
    (chat_format(LLAMA3), True, '\n{"name": "f", "parameters": {"x": "}"}}', (None, None, [("f", {"x": "}"})])),
    (chat_format(LLAMA3), True, "Paris is in France.", ("Paris is in France.", None, [])),
    (chat_format(LLAMA3), True, '{"no": "name"}', ('{"no": "name"}', None, [])),
    (chat_format(MISTRAL), True, 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     ("Sure.", None, [("f", {"x": 1}), ("g", {})])),
    (chat_format(MISTRAL), True, '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{}',
     (None, None, [("f", {"x": 1}), ("g", {})])),
    (chat_format(MISTRAL), True, "[TOOL_CALLS]f[ARGS]{broken", ("[TOOL_CALLS]f[ARGS]{broken", None, [])),
    (chat_format(HARMONY), True, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                                 "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                                 '{"city": "Paris"}<|call|>',
     (None, "Need the weather.", [("get_weather", {"city": "Paris"})])),
    (chat_format(HARMONY), True, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                                 "<|message|>Hello there!<|return|>",
     ("Hello there!", "Easy.", [])),
    (chat_format(GEMMA4), True, f"<|channel>thought\nThe user wants weather.<channel|>Let me check.<|tool_call>call:"
                                f"get_weather{{city:{Q}Paris{Q},unit:{Q}celsius{Q}}}<tool_call|>",
     ("Let me check.", "The user wants weather.", [("get_weather", {"city": "Paris", "unit": "celsius"})])),
    (chat_format(GEMMA4), True, f"<|tool_call>call:f{{n:3, xs:[1,-2.5e1,{Q}a, b}}{Q}],o:{{k:true,z:null}},"
                                f"{Q}quoted key{Q}:{Q}{Q}}}<tool_call|><|tool_call>call:g{{}}<tool_call|>",
     (None, None, [("f", {"n": 3, "xs": [1, -25.0, "a, b}"], "o": {"k": True, "z": None}, "quoted key": ""}),
                   ("g", {})])),
    (chat_format(GEMMA4), True, "<|tool_call>call:f{x:}<tool_call|> and <|tool_call>call:f{x:1} trailing<tool_call|>",
     ("<|tool_call>call:f{x:}<tool_call|> and <|tool_call>call:f{x:1} trailing<tool_call|>", None, [])),
    (chat_format(GEMMA4), False, f"Hi <|tool_call>call:g{{}}<tool_call|>",  # tool_choice none
     ("Hi <|tool_call>call:g{}<tool_call|>", None, [])),
    (chat_format(HARMONY), False, "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis"
                                  "<|message|>Two.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     ("Done.", "One.\n\nTwo.", [])),
]


@pytest.mark.parametrize("fmt, tools, text, expected", CASES, ids=[f"{i}-{c[0].tools}" for i, c in enumerate(CASES)])
def test_every_split_of_an_answer_gives_the_whole_answers_result(fmt: ChatFormat, tools: bool, text: str,
                                                                 expected: tuple) -> None:
    settings = OutputSettings(fmt, tools)
    whole = settings.parse(text)
    assert plain(whole) == expected
    for pieces in splits(text, random.Random(text)):
        together, result = streamed(settings, pieces)
        assert together == result, pieces
        assert plain(result) == expected, pieces


def test_prose_streams_at_once_and_only_what_may_start_a_marker_waits() -> None:
    parser = OutputParser(HERMES)
    assert parser.feed("<think>").reasoning == ""
    assert parser.feed("Plan ").reasoning == "Plan"  # trailing space held: it may be the reasoning's end
    assert parser.feed("it.</thi").reasoning == " it."
    assert parser.feed("nk>\n\nHello").content == "Hello"
    assert parser.feed(" wor").content == " wor"
    assert parser.feed("ld <tool").content == "ld"  # " <tool" may open a call
    assert parser.feed("kit> is a word").content == " <toolkit> is a word"
    delta = parser.feed(f"<tool_call>{WEATHER}")
    assert delta.content == "" and not delta.calls  # a call waits for its end
    delta = parser.feed("</tool_call>")
    assert [c.name for c in delta.calls] == ["get_weather"] and delta.call_index == 0
    assert not parser.finish().content


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER.replace('Paris', 'Rome')}</tool_call>"
    result = OutputSettings(HERMES, True, max_calls=1).parse(text)
    assert [json.loads(c.arguments)["city"] for c in result.calls] == ["Paris"] and result.content is None


@pytest.mark.parametrize("fmt", [HERMES, chat_format(LLAMA3), chat_format(MISTRAL), chat_format(HARMONY),
                                 chat_format(GEMMA4)], ids=lambda f: f.tools)
def test_hostile_model_output_is_prose_not_a_crash(fmt: ChatFormat) -> None:
    """A prompt can make a model write anything: calls nested 100,000 deep or with 10,000-digit
    numbers are no calls, and cost no recursion error."""
    deep = '{"name": "f", "arguments": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001
    digits = '{"name": "f", "arguments": {"n": ' + "9" * 10_000 + "}}"
    for body in (deep, digits):
        text = {"hermes": f"<tool_call>{body}</tool_call>", "llama3": body, "mistral": f"[TOOL_CALLS][{body}]",
                "harmony": f"<|channel|>commentary to=functions.f<|message|>{body[27:-1]}<|call|>",
                "gemma4": "<|tool_call>call:f" + body[27:-1].replace('"a": ', "a:").replace('"n": ', "n:")
                + "<tool_call|>"}[str(fmt.tools)]
        result = OutputSettings(fmt, True).parse(text)
        assert not result.calls and result.content
