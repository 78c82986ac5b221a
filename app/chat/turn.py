"""The turn controller: from a conversation's history to its saved answer, one answer at a
time. Qt-free (no widget, no signal, no timer): the chat page shows what it says, the workers
run the model, and tests drive it with a real database and no window.

A turn: the user's message is stored (the first one creates the conversation, titled from it;
an edited message replaces itself and everything after it), the request is built from the
stored history and the preferences (`answer_request`), the answer's row is created, the request
goes to the engine that runs this conversation (`send`: the local worker, or a remote server's),
and the worker's events (`tokens`, `finish`, `fail`) grow and end the answer. The answer belongs
to its conversation, not to the screen: it goes on while another conversation is shown.

The save rule (what the database holds when):
- before the request is sent, the answer's row exists (empty, complete = 0); Continue marks the
  answer it writes on as incomplete first;
- while the answer is on screen, its text is written just before every render (`save_shown`,
  from the view), so the database holds at least what the window shows;
- in the background, with each chunk once `settings.background_save_seconds` have passed since
  the last write, and at once when its conversation is left (`save`);
- a finished answer gets its text, complete = 1 (0 when stopped), its stats and finish reason;
  a failed one keeps the text it had, complete = 0;
- a thinking model's reasoning is saved with its answer's text, apart from it (the answer's raw
  text is split as it streams: app/chat/reasoning.py), and how long it thought once the answer
  began (or the answer ended while it still thought);
- an answer whose conversation is deleted is dropped (its row went with it: `forget`).

What this does not do: show anything, cancel a request (the page asks the worker's host), or
wait for anything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.chat.reasoning import PLAIN, AnswerFormat, AnswerSplitter, SplitDelta
from app.state.conversations import ConversationStore, StoredMessage, stats_dict, title_from
from app.state.preferences import Preferences
from app.state.remote_engines import parse_engines, resolve
from engine.types import Completion, GenerationRequest, Message, RemoteModel

Send = Callable[[GenerationRequest, RemoteModel | None], int]  # (request, remote or None: local) -> request id


@dataclass(frozen=True)
class TurnSettings:
    """background_save_seconds: how often an answer written in the background reaches the database."""

    background_save_seconds: float = 0.5


@dataclass
class Answer:
    """The answer being written: whose it is and what it holds so far (`text` the answer,
    `reasoning` what the model thought, both without format markers). remote: a remote server
    writes it (else the local engine). thought_from: when its first reasoning arrived;
    reasoning_seconds: how long it thought, once the answer began (None until then)."""

    request_id: int
    conversation_id: int
    message_id: int
    text: str = ""
    tokens: int = 0
    started: float = 0.0
    first_token: bool = False
    remote: bool = False
    saved_at: float = 0.0
    reasoning: str = ""
    thought_from: float | None = None
    reasoning_seconds: float | None = None
    splitter: AnswerSplitter = field(default_factory=lambda: AnswerSplitter(PLAIN), repr=False)

    def thinking_seconds(self, now: float) -> float | None:
        """How long it has thought (so far, while it still does); None: it has not."""
        if self.reasoning_seconds is not None:
            return self.reasoning_seconds
        return now - self.thought_from if self.thought_from is not None else None


@dataclass(frozen=True)
class Progress:
    """A chunk of the answer arrived. first: it is the answer's first text; seconds: since it was
    sent; tokens: written so far; delta: what it adds to the answer and to the reasoning;
    thinking: how long the model has thought (None: it has not), done_thinking: the answer began."""

    first: bool
    seconds: float
    tokens: int
    delta: SplitDelta = SplitDelta()
    thinking: float | None = None
    done_thinking: bool = False


@dataclass(frozen=True)
class Ending:
    """How an answer ended, for the view. reason: the finish reason ("stop", "length",
    "cancelled") or "error"; note: the line under the answer; complete: it ended on its own;
    can_continue: the token limit cut it; tail: the text the split held back to the end (for the
    view to show before the answer ends); thinking: how long the model thought (None: it did not)."""

    reason: str
    note: str
    complete: bool
    can_continue: bool = False
    tail: SplitDelta = SplitDelta()
    thinking: float | None = None


def answer_request(prefs: Preferences, system: str, messages: Sequence[StoredMessage], conversation_id: int,
                   continue_final: bool = False) -> GenerationRequest:
    """The request for the next answer of a conversation: its system prompt and `messages`, with
    the settings (budget "auto" as 0: the worker's AutoBudget chooses). `continue_final`: write
    on from the last answer."""
    history = [Message("system", system.strip())] if system.strip() else []
    # the reasoning goes with its answer: the template keeps it or leaves it out of the prompt
    history += [Message(m.role, m.content, reasoning=m.reasoning or None) for m in messages]
    return GenerationRequest(
        messages=tuple(history),
        max_new_tokens=prefs.max_new_tokens,
        sampling=prefs.sampling(),
        speculation=prefs.speculation(),
        continue_final=continue_final,
        conversation=f"conversation-{conversation_id}",  # its KV cache continues turn to turn
    )


def length_note(tokens: int) -> str:
    """The note on an answer the token limit cut (`tokens`: what its last run wrote)."""
    return f"cut at the token limit ({tokens:,} new tokens) · Continue writes on"


def message_meta(m: StoredMessage) -> dict[str, Any]:
    """A stored message's stats (finish reason, new tokens, …); {} when absent or damaged (the
    database is read as data only)."""
    try:
        meta = json.loads(m.stats) if m.stats else {}
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


class TurnController:
    """One answer at a time over `store` (see the module docstring). `send` hands a request to
    the engine that runs it and returns its request id; `clock` is time.monotonic but in tests."""

    def __init__(self, store: ConversationStore, send: Send, settings: TurnSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._send = send
        self.settings = settings or TurnSettings()
        self._clock = clock
        self.answer: Answer | None = None

    @property
    def busy(self) -> bool:
        """An answer is being written (in any conversation)."""
        return self.answer is not None

    @property
    def answering_in(self) -> int:
        """The conversation an answer is being written in (0: none)."""
        return self.answer.conversation_id if self.answer is not None else 0

    @staticmethod
    def route(choice: str, prefs: Preferences) -> RemoteModel | None:
        """The remote model a conversation's engine choice names (None: the local one);
        RemoteError when its server was removed from the settings."""
        return resolve(choice, parse_engines(prefs.remote_engines))

    # ---- the user's message ------------------------------------------------------------------
    def post(self, conversation_id: int, text: str, system: str, engine: str, replace_from: int = 0
             ) -> tuple[int, StoredMessage]:
        """Store the user's `text` in `conversation_id`, or in a new conversation when it is 0
        (titled from the text, with `system` and `engine`); `replace_from`: the id of the message
        an edit replaces (it and everything after it go). Returns (conversation id, message)."""
        if not conversation_id:
            conversation_id = self.store.create(title_from(text), system).id
            self.store.set_engine(conversation_id, engine)
        elif replace_from:
            self.drop_from(conversation_id, replace_from)
        return conversation_id, self.store.add_message(conversation_id, "user", text)

    def drop_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and every later one (regenerate, edit-and-resend)."""
        self.store.delete_messages_from(conversation_id, message_id)

    # ---- the answer --------------------------------------------------------------------------
    def begin(self, conversation_id: int, prefs: Preferences, system: str, remote: RemoteModel | None = None,
              resume: tuple[int, str] | None = None, fmt: AnswerFormat = PLAIN) -> Answer:
        """Start the next answer of `conversation_id`: a new one, or with `resume` (the last
        answer's message id and the text shown) writing on from the last one. `fmt`: how the
        answering model writes reasoning and calls (app/chat/reasoning.py)."""
        assert self.answer is None, "one answer at a time"
        if resume is not None:
            self.store.update_message(resume[0], resume[1], complete=False)
        history = self.store.messages(conversation_id)
        request = answer_request(prefs, system, history, conversation_id, continue_final=resume is not None)
        reasoning, seconds = "", None
        if resume is None:
            message_id, text = self.store.add_message(conversation_id, "assistant", "", complete=False).id, ""
        else:
            message_id, text = resume
            resumed = next((m for m in history if m.id == message_id), None)
            if resumed is not None and resumed.reasoning:
                reasoning, seconds = resumed.reasoning, resumed.reasoning_seconds
        request_id = self._send(request, remote)
        now = self._clock()
        self.answer = Answer(request_id, conversation_id, message_id, text, started=now, remote=remote is not None,
                             saved_at=now, reasoning=reasoning, reasoning_seconds=seconds,
                             splitter=AnswerSplitter(fmt, resume=resume is not None))
        return self.answer

    def owns(self, request_id: int) -> bool:
        """The worker's event for `request_id` is about the answer being written."""
        return self.answer is not None and self.answer.request_id == request_id

    def tokens(self, request_id: int, text: str, tokens: int, shown: bool) -> Progress | None:
        """A chunk of the answer's raw text from the worker (None: not this answer's). In the
        background it is saved once the last save is `background_save_seconds` old; on screen
        the view saves before rendering."""
        answer = self.answer
        if answer is None or answer.request_id != request_id:
            return None
        now = self._clock()
        thought = answer.reasoning_seconds is not None
        delta = self._grow(answer, answer.splitter.feed(text), now)
        answer.tokens += tokens
        first, answer.first_token = not answer.first_token, True
        if not shown and now - answer.saved_at >= self.settings.background_save_seconds:
            self.save()
        return Progress(first, now - answer.started, answer.tokens, delta, answer.thinking_seconds(now),
                        done_thinking=not thought and answer.reasoning_seconds is not None)

    @staticmethod
    def _grow(answer: Answer, delta: SplitDelta, now: float) -> SplitDelta:
        if delta.reasoning:
            if answer.thought_from is None:
                answer.thought_from = now
            answer.reasoning += delta.reasoning
        if delta.content:
            answer.text += delta.content
            if answer.thought_from is not None and answer.reasoning_seconds is None:
                answer.reasoning_seconds = now - answer.thought_from  # the answer began: thinking is over
        return delta

    def save_shown(self, text: str) -> None:
        """The view is about to render `text` of the answer (and reasoning up to the answer's):
        the database gets it first."""
        if self.answer is not None:
            self._write(self.answer, text)

    def save(self) -> None:
        """Write the answer's text now (its conversation is being left, or a save is due)."""
        if self.answer is not None:
            self._write(self.answer, self.answer.text)

    def _write(self, answer: Answer, text: str) -> None:
        now = self._clock()
        self.store.update_message(answer.message_id, text, reasoning=answer.reasoning,
                                  reasoning_seconds=answer.thinking_seconds(now) or 0.0)
        answer.saved_at = now

    def _end(self, answer: Answer) -> tuple[SplitDelta, float | None]:
        """The split's held-back text, decided; how long the model thought."""
        now = self._clock()
        tail = self._grow(answer, answer.splitter.finish(), now)
        if answer.thought_from is not None and answer.reasoning_seconds is None:
            answer.reasoning_seconds = now - answer.thought_from  # it ended while thinking
        return tail, answer.reasoning_seconds if answer.reasoning else None

    def finish(self, request_id: int, completion: Completion) -> Ending | None:
        """The answer ended (stopped included): saved complete (unless stopped) with its stats."""
        answer = self.answer
        if answer is None or answer.request_id != request_id:
            return None
        reason = completion.finish_reason
        stopped = reason == "cancelled"
        note = "stopped" if stopped else length_note(completion.stats.new_tokens) if reason == "length" else ""
        stats = {**stats_dict(completion.stats), "finish_reason": reason}
        tail, thinking = self._end(answer)
        self.store.update_message(answer.message_id, answer.text, complete=not stopped, stats=stats,
                                  reasoning=answer.reasoning, reasoning_seconds=thinking or 0.0)
        self.answer = None
        return Ending(reason, note, complete=not stopped, can_continue=reason == "length", tail=tail,
                      thinking=thinking)

    def fail(self, request_id: int) -> Ending | None:
        """The answer failed: its text so far is kept, incomplete."""
        answer = self.answer
        if answer is None or answer.request_id != request_id:
            return None
        tail, thinking = self._end(answer)
        self.store.update_message(answer.message_id, answer.text, complete=False, reasoning=answer.reasoning,
                                  reasoning_seconds=thinking or 0.0)
        self.answer = None
        return Ending("error", "failed", complete=False, tail=tail, thinking=thinking)

    def forget(self, conversation_id: int) -> bool:
        """`conversation_id` was deleted: an answer being written there is dropped (True: the
        caller stops its request)."""
        if self.answering_in != conversation_id or not conversation_id:
            return False
        self.answer = None
        return True
