"""Speculative decoding, the paper's part of the engine, and the Engine that runs it.

Contract: `generation.Engine.generate(request, cancel)` yields TokenEvents and ends with one
Completion whose text is exactly what the target alone would produce (greedy) or a sample of
the target's own distribution (sampling). tree.py (the token tree and its masks),
sampling.py (logits -> processed distribution -> token, with an explicit torch.Generator) and
verification.py (one target pass over a tree, the acceptance walk, prune_to_accepted) import
nothing else of the engine but the model wrapper; drafting.py grows SpecExec trees and fills
static Sequoia shapes (sequoia.py); text.py is the chat template, detokeniser and EOS;
grammar.py decodes a request's OutputConstraint (JSON Schema, Lark) inside the trees, the
output still exactly the constrained target's.
`generation.load_engine` is the one way the CLI and the app load a pair.

What it does not do: read weight files (engine.loading), place or stream layers
(engine.offload), or choose the tree budget (engine.planning: it is given one).
"""
