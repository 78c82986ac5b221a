"""SpecChat's engine: models, SpecExec speculative decoding, model store. Never imports Qt."""
