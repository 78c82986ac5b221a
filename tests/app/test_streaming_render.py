"""Streaming Markdown: the work per update stays bounded as an answer grows.

Counted, never timed: the characters of Markdown the view renders per update (MessageWidget
counts them), for the shapes that used to re-render everything (one long code block, a list
without blank lines, a line without a newline) and for plain prose; then the same through the
real worker thread and a tiny model.
"""

from __future__ import annotations

import random

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication
from pytestqt.qtbot import QtBot

from app.chat.chunking import HARD_LIMIT, LINE_LIMIT, Chunker, split_chunks
from app.chat.markdown import LIGHT, code_blocks
from app.chat.view import ChatView, MessageWidget

SHAPES = {
    "prose": lambda i: f"Sentence {i} of a paragraph with several words in it. " + ("\n\n" if i % 5 == 4 else ""),
    "code": lambda i: ("```python\n" if i == 0 else "") + f"x_{i} = compute({i}, 'abc')  # one step\n",
    "list": lambda i: f"- item number {i} with a few words in it\n",
    "line": lambda i: f"word{i} and more words without any newline at all ",
}


def _text(shape: str, n: int) -> list[str]:
    return [SHAPES[shape](i) for i in range(n)]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_pieces_join_to_the_text_however_it_arrives(shape: str) -> None:
    parts = _text(shape, 1500)
    text = "".join(parts)
    whole = split_chunks(text)
    rng = random.Random(shape)
    chunker, at = Chunker(), 0
    while at < len(text):  # arbitrary cuts, even inside lines and fences
        step = rng.randint(1, 300)
        chunker.feed(text[at : at + step])
        at += step
    assert chunker.pieces() == whole
    assert "".join(p.text for p in whole) == text
    assert len(whole) > 5 and max(len(p.markdown()) for p in whole) <= HARD_LIMIT + LINE_LIMIT + 16


def test_a_code_block_cut_into_pieces_is_one_block() -> None:
    code = "".join(f"value_{i} = {i} * 2\n" for i in range(600))
    text = f"Here:\n\n```python\n{code}```\n\nDone.\n"
    pieces = split_chunks(text)
    assert len(pieces) >= 3 and pieces[0].close == "```" and pieces[1].reopen == "```python\n"
    joined = "".join(code_blocks(p.markdown())[0] if p.reopen else "".join(code_blocks(p.markdown())) for p in pieces)
    assert joined == code == code_blocks(text)[0]


def test_copy_takes_a_whole_code_block_cut_into_pieces(qtbot: QtBot) -> None:
    code = "".join(f"value_{i} = {i} * 2\n" for i in range(600))
    widget = MessageWidget("assistant", f"Here:\n\n```python\n{code}```\n\nDone.\n", LIGHT)
    qtbot.addWidget(widget)
    assert len(widget.bodies) >= 3
    html = [b.toHtml() for b in widget.bodies]
    assert "copy:0" in html[0] and not any("copy:" in h for h in html[1:-1])  # one header, on the first piece
    widget.bodies[0].anchorClicked.emit(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == code


def _stream(view: ChatView, parts: list[str], per_flush: int) -> list[int]:
    """Stream `parts` into the view, rendering every `per_flush` parts; characters rendered per render."""
    widget = view.begin_answer()
    counts = []
    for i, part in enumerate(parts):
        view.append_answer(part)
        if i % per_flush == per_flush - 1:
            before = widget.rendered_chars
            view.flush()
            counts.append(widget.rendered_chars - before)
    view.end_answer()
    return counts


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rendering_per_update_does_not_grow_with_the_answer(qtbot: QtBot, shape: str) -> None:
    view = ChatView()
    qtbot.addWidget(view)
    parts = _text(shape, 3000)  # ~150 kB, one render per 10 parts
    counts = _stream(view, parts, 10)
    assert "".join(parts) == view.messages[-1].text
    quarter = len(counts) // 4
    early, late = sum(counts[:quarter]) / quarter, sum(counts[-quarter:]) / quarter
    # re-rendering the whole answer would make the late renders ~7x the early ones
    assert late <= 1.5 * early + 200, (early, late)
    delta = max(len(p) for p in parts) * 10
    assert max(counts) <= 2 * (HARD_LIMIT + LINE_LIMIT) + delta
