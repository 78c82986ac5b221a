"""The OpenAI-compatible API, both ways: SpecChat as a server (`specchat serve`, the app's
Server setting) and SpecChat as a client of other servers (vLLM, llama.cpp's server, another
SpecChat), for users who outgrow one machine.

Contract:
- protocol.py: request bodies -> GenerationRequests (one per choice), the engine's events ->
  responses, stream chunks, `usage` (with prompt_tokens_details.cached_tokens and SpecChat's
  figures in usage.specchat) and OpenAI-shaped error bodies. Plain data.
- tools.py: the tool fields of a chat request checked and bounded (tools, tool_choice auto /
  none / required / a named function, parallel_tool_calls, reasoning_effort, an assistant's
  tool_calls).
- constraints.py: `response_format` json_object / json_schema and tool_choice "required" or
  named as a grammar for the engine's constrained decoding (engine.decoding.grammar), calls in
  the model's own format (Hermes/Qwen, Llama 3); what the grammar library refuses is a 400.
- formats.py: the model's chat format read from its template (Hermes/Qwen, Llama 3, Mistral,
  gpt-oss harmony; <think> reasoning) and its answers split into content, reasoning_content
  and tool calls, streamed or whole, the two always agreeing.
- scheduler.py: `GenerationQueue`, one generation at a time in arrival order, a bounded queue
  (full -> 429), a cancel Event per request (a client that disconnects cancels its job and the
  engine is free for the next). It runs any `engine.types.GenerationBackend`: the Engine in
  `specchat serve`, the app's engine thread in the app (which never lets another thread touch
  its Engine).
- guard.py: what a web page in the user's browser could send is refused first: a Host that
  does not name the server (DNS rebinding), a foreign or null Origin, a POST that is not
  application/json; hosts and web pages the user allows get in (with CORS).
- app.py: the Starlette app (/v1/models, /v1/chat/completions, /v1/completions, /health,
  streaming as server-sent events, the API key check, bodies read with engine.untrusted).
- server.py: `ServeSettings` (a non-loopback address needs an API key or an explicit opt-out),
  the bound socket, uvicorn in this thread or a background one.
- remote.py: `RemoteEngine`, a client of any OpenAI-compatible server with the Engine's
  interface (generate(request, cancel) yields TokenEvents and a Completion), so the CLI and the
  app chat with a remote model the way they chat with the local one; `list_models`.

Status codes: 400 bad JSON or parameters, 401 wrong or missing API key, 403 a Host or Origin
not allowed, 404 unknown model or route, 413 prompt longer than the context (or a body over
8 MiB), 415 a POST that is not application/json, 429 queue full, 503 model loading / not loaded
(or an answer cut by a shutdown), 500 an engine failure.

What it does not do: load models or choose budgets (the caller does, as for `chat`), or import
Qt. Only remote.py is imported by the app's chat path; it needs no torch (nor does
protocol.py: grammars are checked with llguidance alone).
"""
