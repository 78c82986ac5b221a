"""Per-token log-probabilities of the answer, for requests that ask for them
(GenerationRequest.logprobs: None = off, and then nothing here runs).

Which distribution. The TARGET's, never the draft's: each written token was chosen by the
engine's `choose` from one row of the target's logits (plain decoding: the pass's own last row;
a tree: the accepted parent node's row, which verification.accept hands to `choose`), and the
recorder wraps `choose`, so it sees exactly the rows that chose the tokens. The values are the
log-softmax of that raw row at temperature 1: before the repetition penalty, temperature,
top-k/p, min-p and any grammar's mask. That is what vLLM returns by default (its "raw
logprobs") and what OpenAI's API describes (the model's log-probability of the token); it does
not depend on the sampling settings, so a greedy answer and a sampled one report the same
numbers for the same prefix, and a token a grammar forced can have a low log-probability.

Alternatives: the `k` most likely tokens of the row (ties broken by token id, ascending), among
the tokenizer's ids only (a padded vocabulary's unused rows are never listed). Each token's
bytes are exact for byte-level BPE (GPT-2 style) and SentencePiece byte-fallback vocabularies,
else the UTF-8 of its decoded text.

Cost when on: one log-softmax and one top-k per written token (microseconds on a row the
engine already has), and the bytes of each listed token, cached per engine.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from engine.types import TokenAlternative, TokenLogprob, Tokenizer

Choose = Callable[[torch.Tensor, list[int]], int]  # ((V,) logits, tokens of this step so far) -> token


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet backwards: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenBytes:
    """The bytes each token id stands for, from the tokenizer's own vocabulary, cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.size = len(tokenizer)
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        data = self._cache.get(token_id)
        if data is None:
            data = self._cache[token_id] = self._read(token_id)
        return data

    def _read(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.size:
            return b""
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None else None
        if isinstance(piece, str) and piece:
            special = token_id in self.special
            decoder = _byte_decoder()
            if not special and all(c in decoder for c in piece):  # byte-level BPE
                return bytes(decoder[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if not special and piece.startswith("▁"):  # SentencePiece's word start is a space
                return (" " + piece[1:]).replace("▁", " ").encode("utf-8")
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text.encode("utf-8") if isinstance(text, str) else b""


class LogprobRecorder:
    """Wraps a generation's `choose` and keeps, for every token it picks, the token's
    log-probability and the top `k` alternatives of the row it picked from (module docstring).

    A step may call `choose` several times (a tree walk, one call per written token) and may be
    run again after an out-of-memory (the walk restarts): an entry is stored at its place in the
    step (the length of the step's tokens so far), so a rerun overwrites. `commit(n)` moves the
    step's first n entries (those written: the step may be cut after an EOS) to the answer."""

    def __init__(self, choose: Choose, k: int, token_bytes: TokenBytes) -> None:
        self._choose = choose
        self.k = k
        self.token_bytes = token_bytes
        self._step: list[TokenLogprob] = []
        self.answer: list[TokenLogprob] = []
        self._sent = 0  # entries handed out with events so far

    def choose(self, logits: torch.Tensor, step_tokens: list[int]) -> int:
        token = self._choose(logits, step_tokens)
        del self._step[len(step_tokens):]
        self._step.append(self.entry(logits, token))
        return token

    def entry(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """One token's entry from the (V,) raw logits row that chose it."""
        logp = torch.log_softmax(logits.float(), dim=-1)[: self.token_bytes.size]  # (V',) the tokenizer's ids
        top: tuple[TokenAlternative, ...] = ()
        if self.k:
            values, ids = torch.topk(logp, min(self.k, int(logp.shape[0])))  # (k,)
            # sorted by (-logp, id): torch.topk's order among equal values is not specified
            ranked = sorted(zip(values.tolist(), ids.tolist(), strict=True), key=lambda vi: (-vi[0], vi[1]))
            top = tuple(self._alternative(int(i), float(v)) for v, i in ranked)
        chosen = float(logp[token]) if token < logp.shape[0] else float("-inf")
        return TokenLogprob(self._alternative(token, chosen), top)

    def _alternative(self, token: int, logprob: float) -> TokenAlternative:
        data = self.token_bytes(token)
        return TokenAlternative(token, data.decode("utf-8", errors="replace"), data, logprob)

    def commit(self, n: int) -> None:
        self.answer.extend(self._step[:n])
        self._step.clear()

    def take(self) -> tuple[TokenLogprob, ...]:
        """The committed entries not handed out yet (for the next event)."""
        out = tuple(self.answer[self._sent:])
        self._sent = len(self.answer)
        return out
