"""Text in and out of the token world: prompts through the model's chat template, streaming
detokenisation with stop strings, and the model's end-of-sequence ids.

What this module does not do: decide tokens (sampling, verification) or load tokenizers.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest
from engine.types import GenerationRequest, Tokenizer
from engine.untrusted import MIB, Overran, run_within

TEMPLATE_SECONDS = 30.0  # real templates take milliseconds, even for a conversation of thousands of messages
RENDERED_PER_CHARACTER = 8  # a template repeats a system prompt, wraps each message: never 8 times the text


def encode_prompt(tokenizer: Tokenizer, request: GenerationRequest) -> list[int]:
    """Token ids of the request's prompt: a raw prompt as it is (with the tokenizer's own
    special tokens, e.g. BOS), chat messages through the model's chat template with the
    assistant's turn opened."""
    if request.raw_prompt is not None:
        ids = list(tokenizer(request.raw_prompt, add_special_tokens=True)["input_ids"])
    else:
        if not request.messages:
            raise InvalidRequest("The prompt is empty: type a message first.")
        if not tokenizer.chat_template:
            raise InvalidRequest("This model has no chat template; use --raw-prompt to feed plain text.")
        text = render_chat(tokenizer, request)
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise InvalidRequest("The prompt is empty: type a message first.")
    return ids


def render_chat(tokenizer: Tokenizer, request: GenerationRequest, seconds: float | None = None) -> str:
    """The request's messages through the model's chat template, as text (what
    apply_chat_template(tokenize=True) then tokenizes without special tokens). The template is
    the model's code: sandboxed, but free to loop for hours or render gigabytes, so it gets
    `seconds` (default TEMPLATE_SECONDS) and at most RENDERED_PER_CHARACTER times the
    conversation's text (plus 1 MiB)."""
    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    msgs = [{"role": m.role, "content": m.content} for m in request.messages]
    options = {"continue_final_message": True} if request.continue_final else {"add_generation_prompt": True}
    try:  # continue_final: the answer's own end-of-turn is left out, so it goes on
        text = run_within(seconds, lambda: tokenizer.apply_chat_template(msgs, tokenize=False, **options))
    except Overran:
        raise InvalidRequest(f"The model's chat template did not finish this conversation in {seconds:g} s (it may "
                             "loop without end): the model's files are faulty. A raw prompt (--raw-prompt) skips the "
                             "template.") from None
    except Exception as exc:  # noqa: BLE001 - the template is the model's own (sandboxed) code: any error is its refusal
        raise InvalidRequest(template_refusal(exc, request)) from exc
    given = sum(len(m["content"]) for m in msgs)
    if not isinstance(text, str) or len(text) > RENDERED_PER_CHARACTER * given + MIB:
        raise InvalidRequest(f"The model's chat template turned {given:,} characters of conversation into "
                             f"{len(text) if isinstance(text, str) else 0:,}: the model's files are faulty. A raw "
                             "prompt (--raw-prompt) skips the template.")
    return text


def template_refusal(exc: Exception, request: GenerationRequest) -> str:
    """What to tell a user whose conversation the model's chat template refused (templates
    raise e.g. "Conversation roles must alternate user/assistant/user/assistant/...")."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200].rstrip(".")
    hint = ("Many templates take no system message: try without one. " if any(m.role == "system" for m in
            request.messages) else "")
    return (f"The model's chat template refused this conversation ({reason}). {hint}A raw prompt "
            "(--raw-prompt) skips the template.")


def eos_ids(tokenizer: Tokenizer, *configs: Any) -> frozenset[int]:
    """Every id that ends an answer: `eos_token_id` of each config (int or list; generation
    configs often list several, e.g. Llama 3's <|eot_id|>) and the tokenizer's own."""
    ids: set[int] = set()
    for source in configs:
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class Detokenizer:
    """Incremental text for streaming: holds back an incomplete UTF-8 character and any tail
    that could be the start of a stop string; cuts the text at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # what has been emitted so far

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """The new text of the answer `ids` (all of it so far) and whether a stop string ended it."""
        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(full, str), "one sequence of ids decodes to one string"
        stopped = False
        for s in self.stops:
            at = full.find(s)
            if at >= 0:
                full, stopped, final = full[:at], True, True
        if not final:
            if full.endswith("\ufffd"):
                full = full.rstrip("\ufffd")
            hold = 0
            for s in self.stops:
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            full = full[: len(full) - hold]
        if not full.startswith(self.text):  # tokenizer re-segmented earlier text; keep what was shown
            full = self.text + full[len(self.text):]
        delta = full[len(self.text) :]
        self.text = full
        return delta, stopped
