"""engine.model.cache.steady_attention, the attention switch load_model throws for a model on a GPU."""

from __future__ import annotations

import torch

from engine.model.cache import steady_attention


def test_steady_attention_turns_cudnns_attention_off_and_nothing_else() -> None:
    """The switch load_model throws for a GPU model (engine.model.cache.steady_attention) exists in
    this build and leaves the other SDPA kernels as they were."""
    others = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
              torch.backends.cuda.math_sdp_enabled())
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        steady_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled()) == others
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
