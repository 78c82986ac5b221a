"""Context candidates: continuations of the text so far copied from earlier in it.

Answers repeat what they read: code being edited, a paragraph with a typo fixed, a list being
continued, quotes, names. If the last few tokens occurred before (in the prompt, the
conversation or the answer), the tokens that followed them then are a likely continuation now
(prompt lookup / n-gram decoding). `ContextIndex` keeps, for every n-gram of 1..MAX_NGRAM
tokens, where it ended, updated as tokens are committed; `continuations` returns the distinct
continuations of the current end, longest match first, most recent first, each with the length
of its match (how many tokens before the end agree), which the acceptance model turns into a
prior (acceptance.py). They cost no model pass; the tree merges them with the draft's branches
(drafting.py), so verification, and losslessness, are unchanged.

What this module does not do: decide how many candidates pay (the engine does, from their
measured acceptance and the pass cost).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_NGRAM = 4  # n-grams indexed; a match is then extended backwards up to MAX_MATCH
MAX_MATCH = 32


@dataclass(frozen=True)
class Continuation:
    tokens: tuple[int, ...]
    match: int  # tokens before the end that agree with the text before the copied tokens


class ContextIndex:
    """Positions of the n-grams of a growing token sequence."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(MAX_NGRAM + 1)]
        if tokens:
            self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens."""
        seq = self.tokens
        for t in tokens:
            seq.append(t)
            end = len(seq)
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self._ends[n].setdefault(tuple(seq[end - n:]), []).append(end)

    def continuations(self, depth: int, count: int) -> list[Continuation]:
        """Up to `count` distinct continuations of at most `depth` tokens of the sequence's
        end, from earlier occurrences of its last 1..MAX_NGRAM tokens: longest match first,
        then the most recent."""
        seq, end = self.tokens, len(self.tokens)
        found: list[Continuation] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(MAX_NGRAM, end - 1), 0, -1):
            starts = self._ends[n].get(tuple(seq[end - n:]), ())
            scored = []
            for pos in reversed(starts):  # most recent first
                if pos >= end:
                    continue  # the end itself
                cont = tuple(seq[pos : pos + depth])
                if not cont or cont in seen:
                    continue
                scored.append((self._match(pos, n), cont))
                if len(scored) >= 4 * count:
                    break
            for match, cont in sorted(scored, key=lambda mc: -mc[0]):  # stable: recency breaks ties
                if cont not in seen:
                    seen.add(cont)
                    found.append(Continuation(cont, match))
            if len(found) >= count:
                break
        return sorted(found, key=lambda c: -c.match)[:count]

    def _match(self, pos: int, n: int) -> int:
        """How many tokens before `pos` equal those before the end (at least n)."""
        seq, end = self.tokens, len(self.tokens)
        k = n
        while k < MAX_MATCH and pos - k - 1 >= 0 and seq[pos - k - 1] == seq[end - k - 1]:
            k += 1
        return k


def trie(continuations: list[Continuation]) -> tuple[list[int], list[int], list[int]]:
    """The continuations as a tree below a root (node 0, not listed): (tokens, parents, match)
    of nodes 1.., parent-before-child; shared prefixes become one node carrying the longest
    match among the continuations through it."""
    tokens: list[int] = []
    parents: list[int] = []
    match: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        node = 0
        for t in cont.tokens:
            key = (node, t)
            if key in children:
                node = children[key]
                match[node - 1] = max(match[node - 1], cont.match)
                continue
            tokens.append(t)
            parents.append(node)
            match.append(cont.match)
            node = children[key] = len(tokens)
    return tokens, parents, match

