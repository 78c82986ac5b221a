"""CI (.ci/run) runs the README's "Run the tests" command verbatim, and that command ends with
the type check, so a type error in engine/ or app/ fails CI as a failing test does."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_test_command() -> str:
    after = (REPO / "README.md").read_text(encoding="utf-8").split("Run the tests:", 1)[1]
    return after.split("```sh\n", 1)[1].split("\n```", 1)[0].strip()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    command = readme_test_command()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert command in ci_lines
    assert command.endswith("&& python -m pytest && python -m mypy")
