"""The threads that do the app's slow work, and the API server that shares the engine.

- `host.WorkerHost`: the one wiring of a worker QObject in its QThread (queued requests,
  `threading.Event` cancels, shutdown that joins).
- `generation.GenerationWorker`: streams any backend's `generate()` (coalesced tokens, a cancel
  Event, finished/failed signals); `engine_worker` (the local Engine: load, unload, the starter,
  warm-up, measured speeds, budget "auto" through engine.decoding.auto_budget) and
  `remote_worker` (OpenAI-compatible servers) build on it.
- `download_worker`, `benchmark_worker` (benchmark and calibration), `scan_worker` (models on
  disk: LM Studio's and Ollama's folders, damaged files).
- `api_server`: Settings > Server's OpenAI-compatible API over the local engine's worker.

Contract: signals carry plain data (str, int, float, the engine's frozen dataclasses); no
widget is touched and no GUI reply is waited for. Imports `state` only.
"""
