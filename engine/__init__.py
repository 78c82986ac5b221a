"""SpecChat's engine: big models offloaded to RAM, SpecExec speculative decoding, the model
store and the command line. Never imports Qt or the app.

Packages by role (each __init__ states its contract): decoding (the paper and the Engine),
model (the layer-by-layer decoder and its KV cache), offload (packed layers off the device),
loading (where models come from), planning (the hardware profile and the cost model), store
(catalog, local models, downloads), serving (the OpenAI-compatible server), cli (`specchat`);
testing builds random models for tests and benchmarks (the product never imports it). types,
shapes, errors, paths, units and untrusted (bounded reads of outside data) are the
shared vocabulary; interrupts notes a Ctrl+C for the entry points before anything imports.
"""

from engine.notices import quiet_optional_kernels

quiet_optional_kernels()  # before anything imports bitsandbytes (engine/notices.py)
