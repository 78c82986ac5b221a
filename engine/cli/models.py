"""`specchat models list|download ID|import [PATH]|remove ID` (arguments in parser.py).

`list` also shows the GGUFs LM Studio and Ollama keep (usable in place by the name shown), and
marks a local model whose files are damaged (a GGUF shorter than its tensors, a shard cut short)
with a `!` line; each file it could not read from outside is one `!` line too, and the rest
still shows. `import` without a PATH registers every runnable one of them, by reference; one
that cannot be imported is a `note:` line and the others still are.

CLI output goes to stdout (results) and stderr (progress bar, errors). An EngineError goes to
main.py (one `error:` line, exit 1, or 2 for a usage error); Ctrl-C during a download keeps the
partial data (exit 130). On a terminal the download's progress is a tqdm bar that fits the
terminal's width; on a pipe or file, one plain line per 10 % and per event.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from engine.cli.parser import EXIT_INTERRUPTED
from engine.errors import EngineError, ModelNotFound, UsageError
from engine.store.catalog import usable_catalog
from engine.store.discover import Discovery, app_folders, discover_models
from engine.store.download import download_model
from engine.store.integrity import model_damage
from engine.store.names import default_import_name, name_key
from engine.store.paths import default_models_dir, hf_hub_cache_dir
from engine.store.registry import (
    FOUND_SOURCES,
    find_local_model,
    found_as_local,
    import_model,
    list_local_models,
    match_local,
    remove_model,
)
from engine.store.transfer import DownloadSettings
from engine.types import DownloadProgress
from engine.units import format_bytes


def run_models(args: argparse.Namespace) -> int:
    """Run one `models` action; returns the exit code."""
    models_dir = args.models_dir or default_models_dir()
    if args.models_command == "list":
        return _list(models_dir, args.json, sys.stdout)
    if args.models_command == "download":
        return _download(args, models_dir)
    if args.models_command == "import" and args.path is None:
        return _import_found(models_dir, args.copy)
    if args.models_command == "import":
        model = import_model(args.path, models_dir, args.name, args.copy)
        how = "copied into" if args.copy else "registered in (files stay in place)"
        print(f"imported {model.model_id} ({format_bytes(model.size_bytes)}), {how} {models_dir}")
        print(model.path)
        return 0
    if args.models_command == "remove":
        return _remove(args, models_dir)
    raise AssertionError(args.models_command)


def _list(models_dir: Path, as_json: bool, out: TextIO) -> int:
    catalog = usable_catalog()
    found = discover_models()
    local = list_local_models(models_dir, hf_hub_cache_dir(), found.models)
    here = {m.id for m in catalog.models if match_local(local, m.id, m) is not None}
    own = [m for m in local if m.source not in FOUND_SOURCES]  # the found ones get their own section
    damage = {m.path: model_damage(m.path) for m in own}  # found ones were checked by discovery
    role = {m.id: m.role for m in catalog.models}
    if as_json:
        json.dump({
            "models_dir": str(models_dir),
            "local": [{"id": m.model_id, "repo_id": m.repo_id, "source": m.source, "path": str(m.path),
                       "size_bytes": m.size_bytes, "detail": m.detail, "damaged": damage.get(m.path) or None}
                      for m in local],
            "found": [{"name": f.name, "app": f.app, "path": str(f.path), "size_bytes": f.size_bytes,
                       "architecture": f.architecture, "quantisation": f.quantisation, "runnable": f.runnable,
                       "note": f.note} for f in found.models],
            "found_problems": list(found.problems),
            "catalog": [{"id": m.id, "repo_id": m.repo_id, "file": m.gguf_file, "role": m.role,
                         "format": m.format_label, "prequantised": m.prequantised,
                         "download_bytes": m.download_bytes, "parameters": m.parameters, "license": m.license,
                         "gated": m.gated, "local": m.id in here, "model_type": m.model_type,
                         "runs": m.runnable, "unsupported": m.unsupported or None,
                         "head_for": list(m.head_for) or None} for m in catalog.models],
            "pairs": [{"id": p.id, "target": p.target, "draft": p.draft or None,
                       "draft_role": role.get(p.draft) if p.draft else None} for p in catalog.pairs],
        }, out, indent=1)
        out.write("\n")
        return 0
    out.write(f"Local models in {models_dir} (and the Hugging Face cache):\n")
    if not own:
        out.write("  (none yet: try `specchat models download smollm2-135m-instruct`)\n")
    for m in own:
        out.write(f"  {m.model_id:<36} {format_bytes(m.size_bytes):>9}  {m.source:<10} {m.path}\n")
        if damage[m.path]:
            out.write(f"  ! {m.model_id} is damaged: {damage[m.path]}. Download it again.\n")
    _write_found(found, out)
    out.write(f"\nCatalog (checked {catalog.checked_on}):\n" if catalog.models else "\nCatalog: unavailable\n")
    for entry in catalog.models:
        mark = "*" if entry.id in here else " "
        gated = "gated" if entry.gated else ""
        out.write(f" {mark}{entry.id:<34} {format_bytes(entry.download_bytes):>9}  {entry.format_label:<11} "
                  f"{entry.parameters / 1e9:6.2f}B  {entry.license:<10} {gated:<5} {entry.repo_id}\n")
        if not entry.runnable:
            out.write(f"      cannot run yet: {entry.unsupported}\n")  # not a "!" line: nothing is damaged
        if entry.is_head:
            out.write(f"      EAGLE-3 head trained for {', '.join(entry.head_for)} (drafts only for it)\n")
    out.write("\nPairs (target + draft):\n")
    for p in catalog.pairs:
        draft = p.draft + (" (EAGLE-3 head)" if role.get(p.draft) == "head" else "") if p.draft \
            else "(no draft: trees from the context)"
        out.write(f"  {p.id:<24} {p.target} + {draft}\n")
    return 0


def _write_found(found: Discovery, out: TextIO) -> None:
    if not found.models and not found.problems:
        return
    out.write("\nFound in LM Studio and Ollama (used where they are, by the name shown):\n")
    for f in found.models:
        out.write(f"  {f.name:<36} {format_bytes(f.size_bytes):>9}  {f.app:<10} {f.detail}\n")
    for line in found.problems:
        out.write(f"  ! {line}\n")


def _import_found(models_dir: Path, copy: bool) -> int:
    """Register every runnable GGUF LM Studio and Ollama keep (by reference unless --copy)."""
    found = discover_models()
    imported = {m.path for m in list_local_models(models_dir)}
    for line in found.problems:
        print(f"note: {line}", file=sys.stderr)
    runnable = [f for f in found.models if f.runnable]
    if not runnable:
        where = ", ".join(str(p) for _, p in app_folders())
        print(f"No GGUF model SpecChat can run was found (looked in {where}).")
        return 0
    for f in runnable:
        if f.path.resolve() in imported:
            print(f"{f.name}: already imported")
            continue
        try:  # one that cannot be imported (its name taken, its file changed since the listing) is a note
            model = import_model(f.path, models_dir, default_import_name(f.name), copy)
        except EngineError as exc:
            print(f"note: {f.name} was not imported: {exc.user_message}", file=sys.stderr)
            continue
        print(f"imported {model.model_id} ({format_bytes(model.size_bytes)}, {f.detail}) from {f.app}: {f.path}")
    return 0


def _download(args: argparse.Namespace, models_dir: Path) -> int:
    settings = DownloadSettings(stall_timeout_s=args.stall_timeout)
    bar = TerminalProgress(sys.stderr)
    cancel = threading.Event()
    try:
        path = download_model(args.model, models_dir, on_progress=bar, cancel=cancel, token=args.token,
                              settings=settings, allow_fallback=not args.no_fallback)
    except KeyboardInterrupt:
        cancel.set()
        bar.finish()  # the message goes below the bar
        print("interrupted: the partial download is kept; run the same command again to resume.", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        bar.finish()
    print(path)
    return 0


def _remove(args: argparse.Namespace, models_dir: Path) -> int:
    model = find_local_model(args.model, models_dir, hf_hub_cache_dir(), usable_catalog())
    if model is None:  # a GGUF LM Studio or Ollama keeps: remove_model explains whose it is
        model = next((found_as_local(f) for f in discover_models().models if name_key(f.name) == name_key(args.model)),
                     None)
    if model is None:
        raise ModelNotFound(f"No local model {args.model!r}. See `specchat models list`.")
    if model.folder is None:
        remove_model(model)  # raises the HF-cache or LM Studio/Ollama explanation
    frees = (f"frees {format_bytes(model.size_bytes)}" if model.owns_files
             else f"frees nothing (the files stay at {model.path})")
    print(f"{model.model_id}: {model.path} — removing it {frees}.")
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("Not removing without confirmation: pass --yes.")
        if input("Remove? [y/N] ").strip().lower() not in ("y", "yes"):
            print("kept.")
            return 0
    freed = remove_model(model)
    print(f"removed {model.model_id}; {format_bytes(freed)} freed.")
    return 0


class TerminalProgress:
    """Download progress on stderr. On a terminal: a tqdm bar that takes the terminal's width
    (and follows it when the window is resized), with each event's message printed above it.
    On a pipe or a file: one plain line per 10 % and per event, which logs read well."""

    WIDTH = 28  # the bar's characters in the plain lines

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._bar: tqdm | None = None
        self._last_decile = -1
        self._last_file = ""

    def __call__(self, event: DownloadProgress) -> None:
        if self._tty:
            self._terminal(event)
        else:
            self._plain(event)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _terminal(self, e: DownloadProgress) -> None:
        if e.message and e.state != "failed":  # main.py prints the error itself
            if self._bar is not None:
                self._bar.write(f"{e.state}: {e.message}", file=self._stream)
            else:
                self._stream.write(f"{e.state}: {e.message}\n")
                self._stream.flush()
        if e.state != "downloading" or not e.bytes_total:
            return
        if self._bar is None:
            self._bar = tqdm(total=e.bytes_total, initial=e.bytes_done, file=self._stream, unit="B",
                             unit_scale=True, unit_divisor=1000, dynamic_ncols=True, mininterval=0.1,
                             leave=True, bar_format="{l_bar}{bar}| {n_fmt}B/{total_fmt}B {rate_fmt} ETA {remaining}")
        bar = self._bar
        if bar.total != e.bytes_total:
            bar.total = e.bytes_total
        bar.set_description_str(e.file_name, refresh=False)
        bar.update(e.bytes_done - bar.n)  # negative after a discarded partial file

    def _plain(self, e: DownloadProgress) -> None:
        if e.state == "downloading":
            fraction = e.bytes_done / e.bytes_total if e.bytes_total else 0.0
            decile = int(fraction * 10)
            if decile != self._last_decile or e.file_name != self._last_file:
                self._last_decile, self._last_file = decile, e.file_name
                filled = int(fraction * self.WIDTH)
                eta = _duration(e.eta_seconds) if e.eta_seconds is not None else "--"
                self._stream.write(f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {fraction * 100:5.1f}% "
                                   f"{format_bytes(e.bytes_done)}/{format_bytes(e.bytes_total)} "
                                   f"{format_bytes(e.bytes_per_second)}/s ETA {eta}  {e.file_name}\n")
        if e.message and e.state != "failed":
            self._stream.write(f"{e.state}: {e.message}\n")
        self._stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
