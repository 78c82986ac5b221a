"""A model's chat template is the model's own code: jinja2's sandbox stops file and attribute
access, but not a template that loops 10^10 times (each range below the sandbox's 100,000) or
renders gigabytes. Rendering gets a time limit and a size bound; either is one InvalidRequest
(an `error:` line, a 400), never a hang of `generate`, the server or the app. The prompt a fair
template gives is the one apply_chat_template(tokenize=True) gives."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.cli.main import main
from engine.decoding.text import encode_prompt, render_chat
from engine.errors import InvalidRequest
from engine.types import GenerationRequest, Message
from engine.untrusted import Overran, run_within

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
LOOPS_WRITING = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
RECURSES = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
# 2^27 bytes at the end: past the size bound, never gigabytes in a test (on a fast machine a 2^40 doubling
# reaches several GB within the time limit: one concatenation is one uninterruptible C call)
DOUBLES = "{% set s = namespace(v='x') %}{% for i in range(27) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}"
WIDE = "{{ 'x' * 100000000 }}"
ASK = GenerationRequest(messages=(Message("system", "Be brief."), Message("user", "hi")), max_new_tokens=2)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_path: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(tiny_target_path)


@pytest.mark.parametrize("template", [LOOPS, LOOPS_WRITING, RECURSES, DOUBLES, WIDE],
                         ids=["silent loops", "writing loops", "recursion", "doubling", "one wide string"])
def test_a_template_that_loops_or_floods_is_refused_in_time(tokenizer, template: str) -> None:  # type: ignore[no-untyped-def]
    fair = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        started = time.monotonic()
        with pytest.raises(InvalidRequest) as exc:
            render_chat(tokenizer, ASK, seconds=1.0)
        assert time.monotonic() - started < 10
        assert "chat template" in exc.value.user_message and "--raw-prompt" in exc.value.user_message
    finally:
        tokenizer.chat_template = fair


def test_a_fair_template_gives_the_prompt_apply_chat_template_gives(tokenizer) -> None:  # type: ignore[no-untyped-def]
    msgs = [{"role": m.role, "content": m.content} for m in ASK.messages]
    assert encode_prompt(tokenizer, ASK) == list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                             tokenize=True)["input_ids"])
    going_on = GenerationRequest(messages=(*ASK.messages, Message("assistant", "Hel")), continue_final=True)
    assert encode_prompt(tokenizer, going_on) == list(tokenizer.apply_chat_template(
        [*msgs, {"role": "assistant", "content": "Hel"}], continue_final_message=True, tokenize=True)["input_ids"])


def test_work_that_ends_in_time_leaves_no_interruption_behind() -> None:
    """The limit's exception is taken back when the work ends first: none lands later in
    the caller's own code, even when the timer fires just as the work returns."""
    overran = 0
    for i in range(300):
        try:
            run_within(0.0005 * (i % 7), lambda: sum(range(3000)))
        except Overran:
            overran += 1
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # Python instructions, where a stray Overran would land
        sum(range(100))
    assert overran < 300


def test_generate_with_a_looping_template_is_one_error_line(tmp_path: Path, tiny_target_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_target_path, model)
    (model / "chat_template.jinja").write_text(LOOPS)
    monkeypatch.setattr("engine.decoding.text.TEMPLATE_SECONDS", 1.0, raising=False)
    started = time.monotonic()
    rc = main(["generate", "--target", str(model), "--prompt", "hi", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert time.monotonic() - started < 30
    assert rc == 1 and out == "" and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "did not finish" in err  # the model's fault: a runtime failure, as for other faulty model files
