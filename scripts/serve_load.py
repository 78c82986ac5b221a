"""Load on `specchat serve`: N clients send one streamed chat completion each, all at once, and
queue on the one engine. Prints requests per minute, time to first token percentiles, and how
every request ended (answered, or refused with the documented 429 queue_full; anything else is
a failure and the exit code says so).

    python scripts/serve_load.py                          # starts `specchat serve` with the starter
    python scripts/serve_load.py --clients 20 --queue-size 8 --max-tokens 64
    python scripts/serve_load.py --url http://127.0.0.1:8765/v1 [--api-key KEY]   # a running server

Without --url it starts `python -m engine serve` (the starter model unless --target, on a free
port, --threads torch threads) and stops it afterwards. "Nothing lost" is checked per request:
an answered stream has a finish reason, a usage chunk whose completion_tokens is non-zero, and
text; the server's own log lines (one per request) are counted against the answers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("Why is the sky blue?", "Name three rivers in Europe.", "What is a prime number?",
           "Give me a tip for learning to cook.", "Explain what a CPU does.")


@dataclass
class Outcome:
    client: int
    sent: float = 0.0
    first_token: float | None = None
    done: float | None = None
    tokens: int = 0
    finish: str | None = None
    text: str = ""
    error: str = ""  # "" = answered; "queue_full" = the documented 429; anything else = a failure
    details: dict[str, object] = field(default_factory=dict)


def one_client(index: int, client: openai.OpenAI, model: str, max_tokens: int, start: threading.Barrier,
               out: Outcome) -> None:
    start.wait()
    out.sent = time.monotonic()
    try:
        stream = client.chat.completions.create(
            model=model, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"{PROMPTS[index % len(PROMPTS)]} (client {index})"}])
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.delta.content:
                    out.first_token = out.first_token or time.monotonic()
                    out.text += choice.delta.content
                out.finish = choice.finish_reason or out.finish
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
                out.details = dict(chunk.usage.model_extra.get("specchat") or {})
        out.done = time.monotonic()
        if not (out.finish and out.tokens and out.text):
            out.error = f"incomplete answer (finish {out.finish}, {out.tokens} tokens)"
    except openai.RateLimitError as exc:
        body = exc.response.json().get("error", {})
        out.error = "queue_full" if body.get("code") == "queue_full" else f"429 {body}"
    except Exception as exc:  # noqa: BLE001 - every other outcome is a failure to report
        out.error = f"{type(exc).__name__}: {exc}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str, list[str], threading.Thread]:
    target = args.target
    if target is None:
        sys.path.insert(0, str(REPO))
        from engine.loading.starter import starter_model

        target = str(starter_model())
    command = [sys.executable, "-m", "engine", "serve", "--target", target, "--port", "0", "--device", "cpu",
               "--queue-size", str(args.queue_size)]
    if args.draft:
        command += ["--draft", args.draft]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(command, cwd=REPO, env=env, text=True, stderr=subprocess.PIPE)
    lines: list[str] = []
    url = ""
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line.rstrip())
        if match := re.search(r"serving (http://\S+/v1)", line):
            url = match.group(1)
        if "ready:" in line or line.startswith("error:"):
            break
    if not url or proc.poll() is not None:
        raise SystemExit("the server did not start:\n" + "\n".join(lines))
    def drain() -> None:  # the rest of the log: one line per request
        for rest in proc.stderr:  # type: ignore[union-attr]
            lines.append(rest.rstrip())

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return proc, url, lines, reader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server's API base URL (default: start one)")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--target", help="model for the started server (default: the starter)")
    parser.add_argument("--draft")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--queue-size", type=int, default=32, help="for the started server")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the started server")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    args = parser.parse_args()

    proc, log, reader = None, [], None
    url = args.url
    if url is None:
        proc, url, log, reader = start_server(args)
    try:
        client = openai.OpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        outcomes = [Outcome(i) for i in range(args.clients)]
        start = threading.Barrier(args.clients)
        threads = [threading.Thread(target=one_client, args=(i, client, model, args.max_tokens, start, outcomes[i]))
                   for i in range(args.clients)]
        t0 = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.monotonic() - t0
    finally:
        if proc is not None:
            proc.send_signal(2)  # SIGINT: the server's Ctrl+C
            proc.wait(60)
            if reader is not None:
                reader.join(10)

    answered = [o for o in outcomes if not o.error]
    refused = [o for o in outcomes if o.error == "queue_full"]
    failed = [o for o in outcomes if o.error and o.error != "queue_full"]
    ttft = [o.first_token - o.sent for o in answered if o.first_token is not None]
    tokens = sum(o.tokens for o in answered)
    served_lines = [line for line in log if line.startswith("specchat: request ")]
    figures = {
        "model": model, "clients": args.clients, "max_tokens": args.max_tokens, "answered": len(answered),
        "refused_queue_full": len(refused), "failed": len(failed), "wall_seconds": round(wall, 2),
        "requests_per_minute": round(len(answered) / wall * 60, 2) if wall else 0.0,
        "tokens_per_second": round(tokens / wall, 2) if wall else 0.0,
        "ttft_p50": round(percentile(ttft, 50), 2) if ttft else None,
        "ttft_p90": round(percentile(ttft, 90), 2) if ttft else None,
        "ttft_p99": round(percentile(ttft, 99), 2) if ttft else None,
        "ttft_max": round(max(ttft), 2) if ttft else None,
        "ttft_min": round(min(ttft), 2) if ttft else None,
        "mean_tokens": round(statistics.mean(o.tokens for o in answered), 1) if answered else 0.0,
        "server_log_lines": len(served_lines) if proc is not None else None,
    }
    print(f"{args.clients} clients at once -> {url} ({model}), {args.max_tokens} tokens at most each")
    print(f"answered {len(answered)}, refused with 429 queue_full {len(refused)}, failed {len(failed)}; "
          f"wall {wall:.1f} s")
    print(f"requests per minute {figures['requests_per_minute']}, {figures['tokens_per_second']} tok/s in all, "
          f"{figures['mean_tokens']} tokens per answer")
    if ttft:
        print(f"time to first token: min {figures['ttft_min']} s, p50 {figures['ttft_p50']} s, "
              f"p90 {figures['ttft_p90']} s, p99 {figures['ttft_p99']} s, max {figures['ttft_max']} s")
    for o in failed:
        print(f"  client {o.client}: {o.error}")
    if proc is not None:
        print(f"server log: {len(served_lines)} request lines for {len(answered)} answers")
    if args.json:
        print(json.dumps(figures))
        print(json.dumps([asdict(o) | {"text": o.text[:40]} for o in outcomes]))
    lost = proc is not None and len(served_lines) != len(answered)
    return 1 if failed or lost else 0


if __name__ == "__main__":
    sys.exit(main())
