"""`specchat serve`: the target (and draft) behind an OpenAI-compatible HTTP API.

The socket is bound first (a port in use fails at once), the server answers /health and 503
while the model loads in a background thread, then requests are answered one at a time
(engine.serving). The engine options are those of `chat`; the text options are the defaults for
what a request leaves out. `--budget auto` is planned for every request
(engine.decoding.auto_budget), as in `chat`. One line per request goes to stderr. Ctrl+C cancels what runs and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from dataclasses import replace
from pathlib import Path

from engine.cli import common
from engine.cli.parser import EXIT_FAILURE
from engine.cli.streaming import status_printer
from engine.decoding.text import template_text
from engine.errors import InvalidRequest
from engine.serving.guard import split_list
from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue, Job, ModelState, describe_error
from engine.serving.server import Server, ServeSettings

log = logging.getLogger(__name__)


def run_serve(args: argparse.Namespace) -> int:
    setup = common.setup(args)
    try:
        settings = ServeSettings(host=args.host, port=args.port, api_key=args.api_key or "",
                                 insecure=args.insecure_no_api_key, queue_size=args.queue_size,
                                 allowed_hosts=split_list(args.allowed_hosts),
                                 allowed_origins=split_list(args.allowed_origins))
    except InvalidRequest as exc:
        raise common.UsageError(exc.user_message) from exc
    status = status_printer()
    target = args.target
    name = args.served_model_name or served_name(target)
    queue = GenerationQueue(settings.queue_size, on_done=lambda job, error: status(job_line(job, error)))
    queue.set_model(ModelState(name, "loading", "starting"))
    base = common.request(args, setup)
    defaults = RequestDefaults(request=base, system=args.system)
    server = Server(settings, queue, lambda: defaults)  # binds now: a taken port fails before the load

    failed: list[str] = []

    def load() -> None:
        try:
            path = target
            if path is None:
                common.quiet_libraries(args.verbose)
                queue.set_model(ModelState(name, "loading", "preparing the starter model"))
                from engine.loading.starter import starter_model

                path = str(starter_model())
            engine = common.load(path, args.draft, args, setup,
                                 lambda m: queue.set_model(replace(queue.model, detail=m)))
            backend = common.planned(engine, status)
            backend.resolve(base)  # says the plan now (each request is planned again as the engine learns)
            queue.set_model(ModelState(name, "ready", context_length=engine.context_length,
                                       chat_template=template_text(engine.tokenizer)), backend)
            status(f"ready: {name} ({common.describe_mode(engine, args, backend.choice())}) at {server.url}")
        except Exception as exc:  # noqa: BLE001 - reported like any CLI error, after the server stops
            log.debug("loading failed", exc_info=True)
            queue.set_model(ModelState(name, "failed", describe_error(exc)))
            failed.append(describe_error(exc))
            server.stop(wait=0)

    status(f"serving {server.url} (model '{name}', loading; key {'required' if settings.api_key else 'not required'})")
    threading.Thread(target=load, name="specchat-load", daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        queue.close(wait=5)
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        return EXIT_FAILURE  # the model could not load: a runtime failure
    status("stopped")
    return 0


def served_name(target: str | None) -> str:
    """The model id clients use: the target's catalog id, folder or file name."""
    if target is None:
        return "SmolLM2-135M-Instruct"
    path = Path(target)
    if path.suffix.lower() == ".gguf":
        return path.stem
    return path.name if path.exists() else target


def job_line(job: Job, error: BaseException | None) -> str:
    """One line per request on stderr: tokens, waits, speed, how it ended."""
    waited = job.waited()
    if job.started is None:
        return f"request {job.id}: cancelled while waiting ({waited:.1f} s)"
    if error is not None:
        return f"request {job.id}: error: {describe_error(error)}"
    done = job.completions
    if not done:
        return f"request {job.id}: no answer"
    new = sum(c.stats.new_tokens for c in done)
    seconds = sum(c.stats.seconds for c in done)
    reasons = ",".join(sorted({c.finish_reason for c in done}))
    return (f"request {job.id}: {len(done)} choice{'s' if len(done) > 1 else ''}, prompt {done[0].stats.prompt_tokens} "
            f"+ {new} tokens, waited {waited:.2f} s, first token {done[0].stats.ttft_seconds:.2f} s, "
            f"{new / seconds if seconds > 0 else 0.0:.1f} tok/s, {reasons}")
