"""A transformers decoder driven layer by layer, and its KV cache.

Contract: `causal_lm.CausalLM.forward(ids, positions, cache, allowed)` runs any token tree
(explicit mask and positions) on top of a `cache.KVCache`, which is written by position and
pruned with `keep(indices)`; logits are computed only for the rows asked for. The layer
modules are transformers' own, so numerics equal the Hugging Face model's.

What it does not do: load weights (engine.loading), stream offloaded layers (engine.offload
does; CausalLM hands the layer loop to its streamer), or decide tokens (engine.decoding).
"""
