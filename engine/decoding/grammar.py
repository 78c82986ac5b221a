"""Decoding constrained by a grammar, inside SpecExec trees, without losing the target's
distribution.

A request's OutputConstraint (engine.types: a JSON Schema, or a Lark grammar that may embed
JSON Schemas) is compiled once by llguidance into a matcher over this tokenizer's tokens.
`GrammarState` is that matcher advanced along the committed answer tokens, plus a cursor that
visits paths below them: a path's tokens are consumed on top of the committed ones and rolled
back when the cursor moves to another path (rollback is a stack pop in llguidance, so moving
between neighbouring tree nodes costs a few microseconds).

Why the output stays exact. The constrained target at a node is its processed distribution
restricted to the tokens the grammar allows after the node's path, renormalised: the engine's
`choose` sets the other logits to -inf before the repetition penalty, temperature, top-k/p and
min-p (or the argmax), at every node the acceptance walk reads (verification.accept hands it
the step's tokens so far, which is the node's path). Each emitted token is therefore the token
constrained plain decoding would choose with the same uniform draw; the tree only decides how
many of them one target pass yields. The tree is grown under the grammar too, so no budget is
spent on tokens the walk can never take: context candidates it forbids are dropped (`keep`),
and the draft's distribution at every node it expands is masked the same way (`masks`), so its
children are all allowed and its probabilities are those of a constrained draft (draft-free, the
tokens the grammar forces next enter the tree as a candidate instead: `forced`). An end-of-turn
token is allowed only where the grammar is complete, and once nothing may follow, it is the
only allowed token (the answer ends there).

Cost: masks are computed only for nodes the draft expands and nodes the walk reads; llguidance
computes one in ~5-100 us for a 49k vocabulary, consuming or rolling back a token ~1-2 us.

Imports no torch (the server checks grammars with it before a request queues): masks are numpy
arrays, which the decoder turns into tensors.

What this module does not do: build grammars from API requests or chat formats
(engine.serving.constraints), or decide what happens when an answer is cut by the token limit
(it is then incomplete, as unconstrained text is).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np

from engine.errors import EngineError, InvalidRequest
from engine.types import OutputConstraint, Tokenizer

# JSON is written as json.dumps writes it ({"a": 1, "b": [2, 3]}): one space after ':' and ',',
# none elsewhere. Models write it so, and bounded whitespace keeps an answer from running on in
# blanks. A schema's own "x-guidance" options override these.
JSON_STYLE: dict[str, object] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_MESSAGE = 400  # characters of the library's message quoted in an error


class GrammarFailed(EngineError):
    """The matcher hit one of llguidance's limits mid-answer (a grammar too costly to follow)."""


# A special token named in a Lark grammar as `<%NAME%>` (Mistral's [TOOL_CALLS]: llguidance reads
# `<[id]>` and `<|name|>` forms only); the compiler puts in its id for the tokenizer at hand.
NAMED_TOKEN = re.compile(r"<%(.{1,64}?)%>")


def grammar_text(constraint: OutputConstraint, token_id: Callable[[str], int] | None = None) -> str:
    """The constraint as an llguidance grammar (its JSON form). InvalidRequest when the schema is not
    JSON at all. `token_id` gives the id of a special token the grammar names (`<%NAME%>`);
    None: any id, for checking the grammar without a tokenizer."""
    if constraint.kind == "lark":
        source = NAMED_TOKEN.sub(lambda m: f"<[{token_id(m.group(1)) if token_id else 0}]>", constraint.source)
        return llguidance.LLMatcher.grammar_from_lark(source)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            constraint.source, defaults=JSON_STYLE)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequest(f"{constraint.what}: the JSON Schema is not a JSON object ({_cut(str(exc))}).") from None


def check_constraint(constraint: OutputConstraint) -> None:
    """InvalidRequest naming what llguidance refuses in the grammar (an unknown keyword, a $ref
    to nothing, a format it does not know...), checked without a tokenizer: the server calls it
    before a request queues."""
    text = grammar_text(constraint)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise InvalidRequest(f"{constraint.what} cannot be enforced: {_cut(messages[0] if messages else 'invalid')}. "
                             "Constrained decoding supports most of JSON Schema, but not every keyword.")


def _cut(text: str) -> str:
    """llguidance's message without its listing of the grammar (ours, not the client's) and the
    position in it, on one line."""
    lines = text.strip().splitlines()
    text = re.sub(r"^at \d+\(\d+\): ", "", lines[0] if lines else "")
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "…"


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Its token table (llguidance.LLTokenizer) is built on
    the first compile (~0.4 s for a 49k vocabulary) and kept. `width`: the logits' width (the
    model's vocabulary, which may exceed the tokenizer's); `eos_ids`: the tokens that end an
    answer, allowed only where the grammar is complete."""

    def __init__(self, tokenizer: Tokenizer, width: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.width = width
        self.eos_ids = eos_ids
        self._table: llguidance.LLTokenizer | None = None

    @property
    def table(self) -> llguidance.LLTokenizer:
        if self._table is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None or not hasattr(backend, "to_str"):
                raise InvalidRequest("Constrained decoding needs the model's fast (tokenizer.json) tokenizer, which "
                                     "this model does not have.")
            backend = copy.copy(backend)  # padding and truncation off on a copy, as llguidance.hf does
            backend.no_padding()
            backend.no_truncation()
            self._table = llguidance.LLTokenizer(backend.to_str(), n_vocab=max(self.width, len(self.tokenizer)),
                                                 eos_token=sorted(self.eos_ids))
        return self._table

    def compile(self, constraint: OutputConstraint) -> Grammar:
        """InvalidRequest when llguidance refuses the grammar (naming why)."""
        text = grammar_text(constraint, self._special)
        matcher = llguidance.LLMatcher(self.table, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{constraint.what} cannot be enforced: {_cut(matcher.get_error())}.")
        return Grammar(constraint, matcher, self.width, self.eos_ids)

    def _special(self, name: str) -> int:
        """The id of the tokenizer's special token `name` (InvalidRequest: it has none)."""
        found = self.tokenizer.get_vocab().get(name)
        if found is None:
            raise InvalidRequest(f"Constrained decoding needs the token {name} in the model's tokenizer, which it "
                                 "does not have.")
        return found


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint; `start()` gives a fresh state for one answer."""

    constraint: OutputConstraint
    matcher: llguidance.LLMatcher  # at the answer's start; never advanced itself
    width: int
    eos_ids: frozenset[int]

    def start(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.width, self.eos_ids, self.constraint.what)


class GrammarState:
    """The grammar after the committed tokens of one answer, and a cursor over paths below them
    (a path: the tokens after the committed ones, e.g. a tree node's tokens below the root).

    End-of-turn tokens are decided here, not by the matcher: one is allowed exactly where the
    grammar accepts (is complete), and nothing is allowed after it. (llguidance's list calls
    refuse EOS once nothing else may follow, and rolling one back is not exact, so the cursor
    never consumes one.)"""

    def __init__(self, matcher: llguidance.LLMatcher, width: int, eos_ids: frozenset[int],
                 what: str = "the output grammar") -> None:
        self._matcher = matcher
        self.width = width
        self.eos_ids = eos_ids
        self._eos = np.array(sorted(t for t in eos_ids if t < width), dtype=np.int64)
        self.what = what
        self._path: list[int] = []  # tokens consumed past the committed ones (never an EOS)
        self.ended = False  # an EOS was committed

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance along tokens the answer has kept (each one allowed: the walk chose it under
        the mask)."""
        if not self._goto(tokens):
            raise GrammarFailed(f"Decoding left {self.what}: {_cut(self._matcher.get_error())}")
        self._path.clear()  # the cursor's path is the new committed state
        self.ended = any(t in self.eos_ids for t in tokens)

    def allows(self, path: Sequence[int]) -> bool:
        """Whether every token of `path` is allowed after the committed tokens and those before it."""
        return self._goto(path)

    def mask(self, path: Sequence[int] = ()) -> np.ndarray:
        """(width,) bool: the tokens allowed after `path` (which the grammar allows)."""
        return self.masks([path])[0]

    def masks(self, paths: Sequence[Sequence[int]]) -> np.ndarray:
        """(len(paths), width) bool: the tokens allowed after each path (an empty row for a path
        the grammar forbids, or one that ended the answer)."""
        bits: list[np.ndarray | None] = []
        accepting = []
        for path in paths:
            if self.ended or not self._goto(path) or (path and path[-1] in self.eos_ids):
                bits.append(None)
                accepting.append(False)
                continue
            accepting.append(self._matcher.is_accepting())
            raw = self._matcher.compute_bitmask()
            if self._matcher.is_error():
                raise GrammarFailed(f"The server could not follow {self.what} any further "
                                    f"({_cut(self._matcher.get_error())}). Simplify the grammar or schema.")
            bits.append(np.frombuffer(raw, dtype=np.uint8))
        size = max((b.shape[0] for b in bits if b is not None), default=(self.width + 7) // 8)
        packed = np.zeros((len(paths), max(size, (self.width + 7) // 8)), dtype=np.uint8)  # (m, bytes)
        for i, b in enumerate(bits):
            if b is not None:
                packed[i, : b.shape[0]] = b
        # llguidance's mask: bit j of 32-bit word w is token 32w + j, little-endian
        allowed = np.unpackbits(packed, axis=1, bitorder="little")[:, : self.width].astype(np.bool_)  # (m, width)
        allowed[:, self._eos] = np.array(accepting, dtype=np.bool_)[:, None]
        return allowed

    def keep(self, tokens: Sequence[int], parents: Sequence[int]) -> list[bool]:
        """Which nodes of a tree (parent before child; node 0 the root, the last committed
        token) the grammar allows, given their path from the root: a node is kept when its
        parent is and its own token is allowed after its parent's path."""
        kept = [True] * len(tokens)
        paths: list[tuple[int, ...]] = [()] * len(tokens)
        for i in range(1, len(tokens)):
            parent = parents[i]
            if not kept[parent]:
                kept[i] = False
                continue
            paths[i] = paths[parent] + (tokens[i],)
            kept[i] = self._goto(paths[i])
        return kept

    def forced(self) -> list[int]:
        """Tokens the grammar forces next after the committed ones (their canonical
        tokenisation; the model may still split the forced text otherwise)."""
        self._goto(())
        return list(self._matcher.compute_ff_tokens())

    def _goto(self, path: Sequence[int]) -> bool:
        """Move the cursor to `path`: roll back to the common prefix, consume the rest. False
        when the grammar forbids a token of it (the cursor then stays at its allowed prefix). An
        EOS is allowed as the path's last token where the grammar accepts; it is not consumed."""
        if self.ended:
            return not path
        here = self._path
        common, end = 0, min(len(here), len(path))
        while common < end and here[common] == path[common]:
            common += 1
        if common < len(here):
            self._matcher.rollback(len(here) - common)
            del here[common:]
        rest = list(path[common:])
        eos_at = next((i for i, t in enumerate(rest) if t in self.eos_ids), len(rest))
        body = rest[:eos_at]
        done = self._matcher.try_consume_tokens(body) if body else 0
        here.extend(body[:done])
        if done < len(body):
            return False
        return eos_at == len(rest) or (eos_at == len(rest) - 1 and self._matcher.is_accepting())

