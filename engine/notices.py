"""Notices from libraries that are not the user's business, kept out of every SpecChat output.

bitsandbytes (0.50) logs a WARNING each time it is imported on a CPU with AVX512-BF16 and
without the optional `kernels` package: "Failed to load CPU gemm_4bit_forward from
kernels-community: No module named 'kernels'. Please make sure you already `pip install
kernels`". SpecChat does not use that kernel (its NF4 layers are de-quantised whole, then
multiplied by PyTorch; the kernel is for bitsandbytes' own 4-bit matmul), and installing
`kernels` would make bitsandbytes download code from the Hugging Face hub at import.
`quiet_optional_kernels()` drops exactly that record: only when the cause is the missing
package. Every other bitsandbytes warning, and that one with any other cause (the package is
there and failed), still shows; the dropped one goes to the debug log.

Installed when `engine` is imported (engine/__init__.py), before anything imports bitsandbytes.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class OptionalKernelsNotice(logging.Filter):
    """Drops bitsandbytes' "pip install kernels" notice when `kernels` is simply not installed."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_KERNELS_NOTICE)):
            return True
        cause = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if isinstance(cause, ModuleNotFoundError) and cause.name == "kernels":
            log.debug("bitsandbytes: the optional 'kernels' package is not installed (not needed by SpecChat)")
            return False
        return True


def quiet_optional_kernels() -> None:
    """Attach the filter to bitsandbytes' CPU logger (once, however often this is called)."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if not any(isinstance(f, OptionalKernelsNotice) for f in logger.filters):
        logger.addFilter(OptionalKernelsNotice())
