"""A thinking model's reasoning in the chat, without a model: the split of an answer's raw text
(app/chat/reasoning.py) against the server's own parser however the text arrives, the Thinking
block of the chat view, the turn controller's timing and saving (a real SQLite file, the clock
stepped by hand), the database migration, the exports with and without reasoning, and what
Settings > Server states per model."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest
from answers import answering
from PySide6.QtCore import Qt
from pytestqt.qtbot import QtBot
from remote_helpers import templates

from app.chat.reasoning import PLAIN, REMOTE, AnswerFormat, AnswerSplitter, answer_format
from app.chat.sidebar import Sidebar
from app.chat.turn import TurnController
from app.chat.view import ChatView
from app.settings.server_tab import ServerTab
from app.state.conversations import MIGRATIONS, SCHEMA_VERSION, ConversationStore
from app.state.preferences import Preferences
from app.state.running import RunningPair
from engine.decoding.text import FORMAT_MARKERS
from engine.serving.formats import OutputSettings
from engine.types import Completion, GenerationRequest, GenerationStats, Message, RemoteModel

ANSWERS = {  # (template, an answer as the engine's text keeps it: the format's markers in place)
    "qwen3": (templates.QWEN, "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello! How can I help?"),
    "qwen3-thinking": (templates.QWEN_THINKING, "The user greets me.\n</think>\n\nHello! **Welcome.**"),
    "gpt-oss": (templates.HARMONY, "<|channel|>analysis<|message|>User greets. Reply briefly.<|end|><|start|>"
                                   "assistant<|channel|>final<|message|>Hello! How can I help?"),
    "remote": ("", "<think>Short thought.</think>\n\nThe answer."),
}


def split(fmt: AnswerFormat, pieces: list[str], resume: bool = False) -> tuple[str, str]:
    splitter = AnswerSplitter(fmt, resume)
    deltas = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas)


def cuts(text: str, rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 9)
        pieces.append(text[at:at + step])
        at += step
    return pieces


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_reasoning_and_answer_come_apart_as_the_server_splits_them_however_the_text_arrives(name: str) -> None:
    template, text = ANSWERS[name]
    fmt = answer_format(template) if template else REMOTE
    reference = OutputSettings(fmt.chat, tools=True).parse(text)  # the API's reasoning_content and content
    assert reference.reasoning and reference.content
    for seed in range(25):
        content, reasoning = split(fmt, cuts(text, random.Random(seed)))
        assert (content, reasoning) == (reference.content, reference.reasoning)
        assert not any(marker in content + reasoning for marker in FORMAT_MARKERS)


def test_a_tool_call_reads_as_a_line_and_no_marker_is_left_in_the_text() -> None:
    qwen, harmony, mistral = (answer_format(t) for t in (templates.QWEN, templates.HARMONY, templates.MISTRAL))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, _ = split(qwen, cuts(f"Let me look.\n{call}", random.Random(1)))
    assert content.strip() == 'Let me look.\n\n**Tool call:** `get_weather({"city": "Paris"})`'
    content, reasoning = split(harmony, [
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'])
    assert (content.strip(), reasoning) == ('**Tool call:** `get_weather({"city": "Paris"})`', "Need weather.")
    assert split(mistral, ["[TOOL_", "CALLS]not a call"]) == ("not a call", "")  # unreadable: text, no marker
    assert split(qwen, ["<tool_call>{broken</tool_call>"])[0] == "{broken"


def test_a_model_without_a_format_and_a_continued_answer_pass_through_untouched() -> None:
    chatml = answer_format(templates.CHATML)
    assert chatml == PLAIN and answer_format("") == PLAIN
    text = "  An answer about the <think> tag,\n\n  kept as written  "
    assert split(chatml, cuts(text, random.Random(2))) == (text, "")
    # a remote model's answer without a <think> block at its start comes as it was sent
    assert split(REMOTE, ["", " ", "<th", "ere you go ", "</think> "]) == (" <there you go  ", "")
    assert split(REMOTE, [" <thi", "nk>Hm.</think>Yes "]) == ("Yes", "Hm.")
    # Continue writes on from stored text: nothing is trimmed, nothing read as reasoning
    assert split(answer_format(templates.QWEN_THINKING), [" and", " more "], resume=True) == (" and more ", "")


def test_the_thinking_block_opens_while_the_reasoning_streams_and_closes_when_the_answer_begins(qtbot: QtBot) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(640, 480)
    view.show()
    saved: list[str] = []
    view.before_render = saved.append
    widget = view.begin_answer()
    assert widget.thinking is None
    view.append_reasoning("The user greets me. ")
    view.flush()
    block = widget.thinking
    assert block is not None and block.is_open and block.title == "Thinking…" and widget.text == ""
    assert not widget.body.isVisibleTo(widget)  # no empty answer under the reasoning
    view.append_reasoning("I greet back.")
    view.flush()
    assert block.text == block.body.toPlainText() == "The user greets me. I greet back."
    view.set_thinking(12.4)
    view.append_answer("Hello!")
    view.flush()
    assert not block.is_open and block.title == "Thinking (12 s)" and widget.text == "Hello!"
    assert widget.body.isVisibleTo(widget)
    assert saved == ["", "", "Hello!"]  # the page saves before every render
    qtbot.mouseClick(block.header, Qt.MouseButton.LeftButton)
    assert block.is_open and block.body.isVisibleTo(widget)
    view.append_answer(" More.")
    view.flush()
    assert block.is_open  # the answer closes it once; after that it stays as the user left it
    qtbot.mouseClick(block.header, Qt.MouseButton.LeftButton)
    assert not block.is_open and not block.body.isVisibleTo(widget)
    view.end_answer(thinking=12.4)
    assert "Thinking (12 s)" in block.header.accessibleName()

    stored = view.add_message("assistant", "Hi", reasoning="Thought.", reasoning_seconds=75)
    assert stored.thinking is not None and stored.thinking.title == "Thinking (1 min 15 s)"
    assert not stored.thinking.is_open
    cut = view.add_message("assistant", "", complete=False, reasoning="Stopped while thinking", reasoning_seconds=0.3)
    assert cut.thinking is not None and cut.thinking.is_open and cut.thinking.title == "Thinking (<1 s)"
    assert view.add_message("assistant", "No reasoning here").thinking is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _completion(reason: str = "stop") -> Completion:
    stats = GenerationStats(prompt_tokens=9, new_tokens=8, target_passes=4, tokens_per_pass=2.0, draft_passes=0,
                            budget=8, seconds=1.0, ttft_seconds=0.1, tokens_per_second=8.0, peak_rss_bytes=0)
    return Completion("", (), reason, stats)  # type: ignore[arg-type]


def test_the_turn_times_the_thinking_and_saves_the_reasoning_apart_from_the_answer(
        conversations: ConversationStore) -> None:
    sent: list[GenerationRequest] = []

    def send(request: GenerationRequest, _remote: RemoteModel | None) -> int:
        sent.append(request)
        return len(sent)

    clock = Clock()
    controller = TurnController(conversations, send, clock=clock)
    conversation, _ = controller.post(0, "hi", "", "")
    answer = controller.begin(conversation, Preferences(), "", fmt=answer_format(templates.QWEN_THINKING))
    clock.now += 1.0
    progress = controller.tokens(answer.request_id, "The user ", 2, shown=False)
    assert progress is not None and progress.first and progress.delta.reasoning == "The user"
    assert progress.thinking == 0.0 and not progress.done_thinking
    clock.now += 4.0
    controller.save()  # leaving the conversation: what it thought so far is kept
    [_, row] = conversations.messages(conversation)
    assert (row.content, row.reasoning, row.reasoning_seconds, row.complete) == ("", "The user", 4.0, False)
    clock.now += 8.0
    progress = controller.tokens(answer.request_id, "greets me.\n</think>\n\nHel", 5, shown=True)
    assert progress is not None and progress.delta.reasoning == " greets me." and progress.delta.content == "Hel"
    assert progress.done_thinking and progress.thinking == 12.0
    clock.now += 3.0
    controller.tokens(answer.request_id, "lo!", 1, shown=True)
    ending = controller.finish(answer.request_id, _completion())
    assert ending is not None and ending.thinking == 12.0 and ending.complete
    [_, row] = conversations.messages(conversation)
    assert (row.content, row.reasoning, row.reasoning_seconds, row.complete) == (
        "Hello!", "The user greets me.", 12.0, True)

    # the next turn's history carries the reasoning with its answer (the template keeps it or not)
    controller.post(conversation, "and now?", "", "")
    controller.begin(conversation, Preferences(), "")
    assert sent[-1].messages[1] == Message("assistant", "Hello!", reasoning="The user greets me.")
    assert sent[-1].messages[0] == Message("user", "hi")


def test_an_answer_that_ends_while_thinking_keeps_its_reasoning(conversations: ConversationStore) -> None:
    clock = Clock()
    controller = TurnController(conversations, lambda _r, _m: 7, clock=clock)
    conversation, _ = controller.post(0, "hi", "", "")
    answer = controller.begin(conversation, Preferences(), "", fmt=answer_format(templates.QWEN_THINKING))
    controller.tokens(answer.request_id, "Still thinking about it  ", 4, shown=False)
    clock.now += 2.5
    ending = controller.finish(answer.request_id, _completion("length"))
    assert ending is not None and ending.thinking == 2.5 and ending.tail.reasoning == ""  # whitespace trimmed
    [_, row] = conversations.messages(conversation)
    assert (row.content, row.reasoning, row.reasoning_seconds) == ("", "Still thinking about it", 2.5)


def test_a_version_3_database_gains_the_reasoning_columns(tmp_path: Path) -> None:
    path = tmp_path / "v3.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(";".join(MIGRATIONS[:3]) + "; PRAGMA user_version = 3;")
    db.execute("INSERT INTO conversations (title, system_prompt, created, updated) VALUES ('Old', '', 1, 1)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'assistant', 'kept', 1)")
    db.commit()
    db.close()
    store = ConversationStore(path)
    assert store.schema_version == SCHEMA_VERSION == 4
    [old] = store.messages(1)
    assert (old.content, old.reasoning, old.reasoning_seconds) == ("kept", "", 0.0)
    store.update_message(old.id, "kept", reasoning="new thoughts", reasoning_seconds=3.5)
    store.close()
    again = ConversationStore(path)
    [new] = again.messages(1)
    assert (new.content, new.reasoning, new.reasoning_seconds) == ("kept", "new thoughts", 3.5)
    again.close()


def test_exports_leave_the_reasoning_out_unless_asked(qtbot: QtBot, conversations: ConversationStore,
                                                       tmp_path: Path) -> None:
    conv = conversations.create("Greetings")
    conversations.add_message(conv.id, "user", "hi")
    answer = conversations.add_message(conv.id, "assistant", "")
    conversations.update_message(answer.id, "Hello!", reasoning="The user greets me.\nI greet back.",
                                 reasoning_seconds=12.2)
    target = tmp_path / "export.md"
    sidebar = Sidebar(conversations, dialogs=answering(path=target))
    qtbot.addWidget(sidebar)
    sidebar.refresh(select=conv.id)
    assert not sidebar.include_reasoning.isChecked()
    sidebar.export_current("md")
    plain = target.read_text(encoding="utf-8")
    assert "Hello!" in plain and "greets" not in plain and "Thinking" not in plain
    sidebar.export_current("json")
    [_, message] = json.loads(target.read_text(encoding="utf-8"))["messages"]
    assert message["content"] == "Hello!" and "reasoning" not in message

    sidebar.include_reasoning.trigger()  # ticked in the export menu
    sidebar.export_current("md")
    assert ("## Assistant\n\n> **Thinking (12 s)**\n>\n> The user greets me.\n> I greet back.\n\nHello!\n"
            in target.read_text(encoding="utf-8"))
    sidebar.export_current("json")
    [_, message] = json.loads(target.read_text(encoding="utf-8"))["messages"]
    assert (message["content"], message["reasoning"], message["reasoning_seconds"]) == (
        "Hello!", "The user greets me.\nI greet back.", 12.2)


def test_settings_server_states_tools_json_and_reasoning_per_loaded_model(qtbot: QtBot) -> None:
    def support(template: str | None) -> str:
        running = None if template is None else RunningPair("/models/tiny", "", None, "FP32", chat_template=template)
        tab = ServerTab(running=running)
        qtbot.addWidget(tab)
        return tab.support.text()

    assert "none" in support(None) and "once a model is loaded" in support(None)
    qwen = support(templates.QWEN_THINKING)
    assert "tiny" in qwen and "<b>Tools:</b></td><td>yes" in qwen and "Hermes/Qwen &lt;tool_call&gt; JSON" in qwen
    assert "<b>JSON output:</b></td><td>yes" in qwen and "required or a named function (forced calls" in qwen
    assert "&lt;think&gt; blocks come back as reasoning_content" in qwen
    harmony = support(templates.HARMONY)
    assert "gpt-oss harmony" in harmony and "the harmony analysis channel comes back as reasoning_content" in harmony
    chatml = support(templates.CHATML)
    assert "<b>Tools:</b></td><td>no. This model's chat template has no tool support" in chatml
    assert "answers are content only" in chatml
    assert "does not know its chat template" in support("")
