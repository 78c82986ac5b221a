"""End to end: a real (tiny) model downloaded from the local hub is usable by its repo id as
--target and --draft, as LM Studio users expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hub_server import FakeRepo, HubServer

from engine.cli.main import main
from engine.store import download_model, resolve_model


def test_downloaded_repo_id_works_as_target_and_draft(
    hub: HubServer, models_dir: Path, tiny_target_path: Path, tiny_draft_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for repo_id, folder in (("acme/tiny-chat", tiny_target_path), ("acme/tiny-chat-draft", tiny_draft_path)):
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        hub.add_repo(FakeRepo(repo_id, files))
        path = download_model(repo_id, models_dir)
        assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
        assert resolve_model(repo_id, models_dir) == path
    rc = main(["generate", "--target", "acme/tiny-chat", "--draft", "acme/tiny-chat-draft", "--raw-prompt",
               "Paris is the capital of", "--max-new-tokens", "8", "--budget", "8", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads(out.splitlines()[-1])
    assert result["stats"]["new_tokens"] >= 1 and result["stats"]["budget"] == 8
