"""Models built for tests and benchmarks, never for a user: tiny random models with a tokenizer
(synthetic.tiny_model, tiny_gguf), large random checkpoints and GGUF files of a chosen size, and
models built in place for `specchat bench gpu` (synthetic), plus the GGUF writer they use
(gguf_write).

Contract: the product (decoding, model, offload, loading, planning, store, serving, the CLI's
chat/generate/serve/models and the app) never imports this package; the benchmarks
(engine/cli/bench*) and the tests do. tests/engine/test_layering.py checks it.
"""
