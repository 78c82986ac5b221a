"""The GGUF architectures SpecChat runs, by llama.cpp's names: one list for the loader
(engine.loading.gguf_families), which refuses the others, and for the model discovery
(discover.py), which marks the others before anything loads. Plain data: `models list` imports
no torch."""

from __future__ import annotations

RUNNABLE = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "gemma4", "gpt-oss", "glm4moe", "qwen3next", "qwen35",
            "qwen35moe")
# how a message names them (Mistral's GGUFs say "llama"; a llama file with experts is Mixtral)
RUNS = ("llama (with experts: Mixtral), mistral, qwen2, qwen3, qwen3moe (Qwen3-MoE), gemma3 (Gemma 3 text), "
        "gemma4 (Gemma 4 text), gpt-oss, glm4moe (GLM-4.5), qwen3next (Qwen3-Next), qwen35 and qwen35moe "
        "(Qwen3.5 / 3.6)")
# architectures gguf-py names whose GGUF SpecChat does not read yet: what is missing
REFUSED: dict[str, str] = {}
