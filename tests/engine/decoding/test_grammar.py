"""Decoding under a grammar stays exact: constrained SpecExec (with a draft, draft-free, static
Sequoia trees) against constrained plain decoding written here from scratch (the Hugging Face
model read anew each step, llguidance's own mask on its logits, argmax), token for token; sampled
first and second tokens against the exact constrained distribution by chi-square, with a power
check; the trees hold only nodes the grammar allows; and what the library refuses is an
InvalidRequest before any step.

The reference builds its own llguidance matcher from the tokenizer (llguidance.hf) and uses the
library's mask as it comes, end-of-turn bit included, so the engine's token table and its own
end-of-turn rule (grammar.GrammarState) are under test too."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from test_lossless_sampling import chi2_pvalue

from engine.decoding.context import ContextIndex, Continuation
from engine.decoding.generation import Engine
from engine.decoding.grammar import JSON_STYLE, GrammarCompiler
from engine.errors import InvalidRequest
from engine.loading.load import LoadedModel
from engine.types import (
    Completion,
    GenerationRequest,
    OutputConstraint,
    SamplingSettings,
    SpeculationSettings,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
JSON = OutputConstraint("json_schema", json.dumps(SCHEMA))
# an example of the format in the prompt: context candidates copy from it
PROMPTS = ['Example: {"name": "Paris", "age": 3, "tags": ["red"], "ok": true}. Another:', "def add(a, b):",
           "Once upon a time there was"]
WORDS = OutputConstraint("lark", 'start: WORD (" " WORD)*\nWORD: /[a-z]+/')


def run(engine: Engine, request: GenerationRequest) -> Completion:
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def unpack(raw: bytes, width: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[:width].astype(bool))


def reference_matcher(engine: Engine, grammar: str) -> llguidance.LLMatcher:
    table = llguidance.hf.from_tokenizer(engine.tokenizer,  # type: ignore[arg-type]
                                         n_vocab=engine.target.shape.vocab_size, eos_token=sorted(engine.eos_ids))
    matcher = llguidance.LLMatcher(table, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def constrained_greedy(engine: Engine, prompt: list[int], grammar: str, n: int) -> list[int]:
    """Plain decoding under the grammar: the whole sequence through the HF model each step, the
    logits the grammar forbids at -inf, argmax."""
    matcher = reference_matcher(engine, grammar)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = engine.target.hf_model(torch.tensor([ids])).logits[0, -1].float()  # (V,)
            allowed = unpack(matcher.compute_bitmask(), logits.shape[-1])
            token = int(logits.masked_fill(~allowed, -torch.inf).argmax())
            out.append(token)
            if token in engine.eos_ids:
                break
            assert matcher.consume_token(token)
            ids.append(token)
    return out


def json_grammar() -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_STYLE)  # type: ignore[arg-type]


SETUPS = {  # name -> (with the draft, speculation)
    "draft": (True, SpeculationSettings(budget=16, max_depth=6)),
    "draft-free": (False, SpeculationSettings(budget=16, max_depth=6, draft=False)),
    "sequoia": (True, SpeculationSettings(budget=16, max_depth=4, tree_mode="sequoia")),
    "autoregressive": (False, SpeculationSettings(mode="autoregressive")),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_constrained_greedy_equals_constrained_plain_decoding(close_engine: Engine, setup: str) -> None:
    with_draft, spec = SETUPS[setup]
    engine = close_engine if with_draft else Engine(close_engine.target, close_engine.tokenizer, None)
    passes = tokens = 0
    for prompt in PROMPTS:
        request = GenerationRequest(raw_prompt=prompt, max_new_tokens=96, constraint=JSON, speculation=spec)
        got = run(engine, request)
        ref = constrained_greedy(engine, engine.encode(request), json_grammar(), 96)
        assert list(got.token_ids) == ref, (setup, prompt)
        assert got.finish_reason == "eos"  # the schema bounds every value: the answer ends, complete
        jsonschema.validate(json.loads(got.text), SCHEMA)
        passes, tokens = passes + got.stats.target_passes, tokens + len(got.token_ids)
    if setup == "draft":  # the draft keeps working under the grammar: several tokens a pass
        assert tokens / passes > 2.5
    if setup == "draft-free":  # the example in the first prompt is copied
        assert passes < tokens


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "draft-free"])
def test_trees_hold_only_nodes_the_grammar_allows(close_engine: Engine, with_draft: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tree the target verifies, node by node, against the reference's own matcher advanced
    along the answer committed before it. Context candidates include forbidden ones (prose where
    JSON goes), which must be dropped while the allowed ones stay."""
    import engine.decoding.generation as generation

    engine = close_engine if with_draft else Engine(close_engine.target, close_engine.tokenizer, None)
    tok = engine.tokenizer
    good = tuple(tok('{"name": "')["input_ids"])
    bad = tuple(tok("Paris is")["input_ids"])
    candidates = [Continuation(good, 8), Continuation(bad, 8), Continuation(good[:1] + bad, 8)]
    monkeypatch.setattr(ContextIndex, "continuations", lambda self, depth, count: candidates[:count])
    if not with_draft:
        monkeypatch.setattr(engine.costs, "best_size", lambda gains, tokens: len(gains))
    trees = []  # (tree, length of the committed sequence, its root included)
    real_run_tree = generation.run_tree

    def spy(target, cache, tree, pending=None):  # type: ignore[no-untyped-def]
        trees.append((tree, cache.length + (0 if pending is None else pending.shape[0]) + 1))
        return real_run_tree(target, cache, tree, pending)

    monkeypatch.setattr(generation, "run_tree", spy)
    request = GenerationRequest(raw_prompt=PROMPTS[1], max_new_tokens=40, constraint=JSON,
                                speculation=SpeculationSettings(budget=24, max_depth=6, draft=with_draft))
    answer = list(run(engine, request).token_ids)
    prompt = len(engine.encode(request))
    assert trees and any(len(tree) > 1 for tree, _ in trees)
    nodes = 0
    for tree, length in trees:
        tree.check()
        matcher = reference_matcher(engine, json_grammar())
        assert matcher.consume_tokens(answer[: length - prompt])
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for node in range(1, len(tree)):
            path = []
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            path.reverse()
            *body, last = path
            assert matcher.validate_tokens(body) == len(body), f"forbidden path {tok.decode(path)!r}"
            probe = matcher.deep_copy()
            assert probe.consume_tokens(body)
            assert bool(unpack(probe.compute_bitmask(), engine.target.shape.vocab_size)[last]), tok.decode(path)
            nodes += 1
    assert nodes > 20
    first = trees[0][0]
    depth_one = {t for t, p in zip(first.tokens.tolist(), first.parents.tolist()) if p == 0}
    assert good[0] in depth_one and bad[0] not in depth_one


def test_the_engine_masks_equal_the_librarys(close_engine: Engine) -> None:
    """GrammarState's masks (end-of-turn by its own rule) against llguidance's, along an answer,
    and its cursor's answers for paths off the answer."""
    compiler = GrammarCompiler(close_engine.tokenizer, close_engine.target.shape.vocab_size, close_engine.eos_ids)
    state = compiler.compile(JSON).start()
    matcher = reference_matcher(close_engine, json_grammar())
    answer = close_engine.tokenizer('{"name": "x", "age": 7, "tags": [], "ok": false}')["input_ids"]
    eos = min(close_engine.eos_ids)
    for i, token in enumerate(answer):
        ref = unpack(matcher.compute_bitmask(), state.width)
        assert torch.equal(torch.from_numpy(state.mask(answer[i:i + 1][:0])), ref), i
        assert torch.equal(torch.from_numpy(state.mask([token])), unpack(_after(matcher, token), state.width))
        assert state.allows([token]) and not state.allows([eos])
        state.commit([token])
        assert matcher.consume_token(token)
    assert matcher.is_accepting() and state.allows([eos]) and not state.allows([eos, answer[0]])
    assert torch.equal(torch.from_numpy(state.mask()), unpack(matcher.compute_bitmask(), state.width))
    assert np.flatnonzero(state.mask()).tolist() == sorted(t for t in close_engine.eos_ids if t < state.width)
    assert not state.mask([eos]).any()  # nothing after the end
    parents = [-1, 0, 1, 0]
    assert state.keep([0, eos, answer[0], answer[0]], parents) == [True, True, False, False]
    forced = compiler.compile(JSON).start().forced()  # the schema's first key: a candidate when draft-free
    assert forced and '{"name": "'.startswith(close_engine.tokenizer.decode(forced))


def _after(matcher: llguidance.LLMatcher, token: int) -> bytes:
    copy = matcher.deep_copy()
    assert copy.consume_token(token)
    return copy.compute_bitmask()


# ---- sampling ----------------------------------------------------------------------------------
N_SAMPLES = 2000
SAMPLE_PROMPT = "Once upon a time there was"


def constrained_distributions(engine: Engine, prompt: list[int],
                              temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(V,) exact first-token and second-token marginals of the target under WORDS."""
    matcher = reference_matcher(engine, llguidance.LLMatcher.grammar_from_lark(WORDS.source))
    model = engine.target.hf_model
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
        width = logits.shape[-1]
        p1 = torch.softmax(logits.masked_fill(~unpack(matcher.compute_bitmask(), width), -torch.inf) / temperature, -1)
        firsts = p1.nonzero()[:, 0]
        batch = torch.cat([torch.tensor(prompt)[None].expand(firsts.shape[0], -1), firsts[:, None]], dim=1)
        after = model(batch).logits[:, -1].float()  # (K, V)
        masks = torch.stack([unpack(_after(matcher, int(t)), width) for t in firsts])
        p2_given = torch.softmax(after.masked_fill(~masks, -torch.inf) / temperature, -1)
    weight = p1[firsts].double() * torch.tensor([int(t) not in engine.eos_ids for t in firsts]).double()
    p2 = (weight[:, None] * p2_given.double()).sum(0)
    return p1.double(), p2 / p2.sum()


def test_constrained_sampling_has_the_constrained_distribution(close_engine: Engine) -> None:
    temperature = 0.8
    prompt = close_engine.tokenizer(SAMPLE_PROMPT)["input_ids"]
    p1, p2 = constrained_distributions(close_engine, prompt, temperature)
    assert int((p1 > 0).sum()) > 20  # the grammar leaves a real choice (lowercase words)
    c1, c2 = torch.zeros_like(p1), torch.zeros_like(p1)
    passes = 0
    for seed in range(N_SAMPLES):
        request = GenerationRequest(raw_prompt=SAMPLE_PROMPT, max_new_tokens=2, constraint=WORDS,
                                    sampling=SamplingSettings(temperature=temperature, seed=seed),
                                    speculation=SpeculationSettings(budget=8, max_depth=2))
        final = run(close_engine, request)
        c1[final.token_ids[0]] += 1
        if len(final.token_ids) > 1:
            c2[final.token_ids[1]] += 1
        passes += final.stats.target_passes
    assert passes < 1.8 * N_SAMPLES, "most samples should take both tokens from one tree pass"
    assert chi2_pvalue(c1, p1) > 1e-3
    assert c2.sum() > 0.9 * N_SAMPLES and chi2_pvalue(c2, p2) > 1e-3
    # power: the same counts reject the target without the grammar, and at a mildly wrong temperature
    with torch.inference_mode():
        logits = close_engine.target.hf_model(torch.tensor([prompt])).logits[0, -1].float()
    free = torch.softmax(logits / temperature, -1)
    assert chi2_pvalue(c1, free.double()) < 1e-3
    q1, _ = constrained_distributions(close_engine, prompt, temperature * 1.25)
    assert chi2_pvalue(c1, q1) < 1e-3


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "draft-free"])
def test_a_seed_samples_the_same_answer_as_constrained_plain_decoding(close_engine: Engine, with_draft: bool) -> None:
    """One uniform draw per token in both modes: the same seed gives the same constrained answer
    with trees as without."""
    engine = close_engine if with_draft else Engine(close_engine.target, close_engine.tokenizer, None)
    for seed in range(6):
        sampling = SamplingSettings(temperature=0.9, top_p=0.95, seed=seed)
        base = GenerationRequest(raw_prompt=PROMPTS[0], max_new_tokens=80, constraint=JSON, sampling=sampling)
        spec = run(engine, GenerationRequest(**{**base.__dict__, "speculation": SpeculationSettings(
            budget=16, max_depth=6, draft=with_draft)}))
        plain = run(engine, GenerationRequest(**{**base.__dict__, "speculation": SpeculationSettings(
            mode="autoregressive")}))
        assert spec.token_ids == plain.token_ids, seed
        if spec.finish_reason == "eos":
            jsonschema.validate(json.loads(spec.text), SCHEMA)


# ---- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, word", [
    (OutputConstraint("json_schema", '{"type": "object", "if": {"required": ["a"]}}'), "if"),
    (OutputConstraint("json_schema", '{"$ref": "#/nope"}'), "nope"),
    (OutputConstraint("json_schema", '{"type": "strin"}'), "strin"),
    (OutputConstraint("json_schema", "[1, 2"), "JSON"),
    (OutputConstraint("lark", "start: missing"), "missing"),
])
def test_what_the_library_refuses_is_an_invalid_request_before_any_step(tiny_target: LoadedModel,
                                                                         constraint: OutputConstraint,
                                                                         word: str) -> None:
    engine = Engine(tiny_target.model, tiny_target.tokenizer, None)
    with pytest.raises(InvalidRequest) as exc:
        engine.generate(GenerationRequest(raw_prompt="x", constraint=constraint))
    assert word in exc.value.user_message and len(exc.value.user_message) < 600
