"""How the CPU's compute threads wait for work, set before the OpenMP runtime starts.

PyTorch's operations and the packed CPU kernel (engine.kernels) share one OpenMP runtime
(GNU's libgomp, which PyTorch ships). Between parallel regions its threads wait: spinning
(the default when nothing is set) answers the next region at once but burns the core, and on a
machine where anything else runs (a browser, the app's own GUI thread, a second team of
threads started from another thread) spinning teams take the cores from the work and a step
collapses (the starter fell from ~35 to ~1 tok/s under load); sleeping (OMP_WAIT_POLICY=PASSIVE)
never collapses but wakes every thread at every region: the fused decode step
(qm_decode_layers, ~150 barriers a step) ran 80-88 tok/s passive against 106-115 spinning.

A bounded spin, GOMP_SPINCOUNT, is both: a thread spins that many times (tens of microseconds,
enough for the gaps between a step's barriers), then sleeps. Measured on the starter's fused
step, quiet 2-core machine, 3 alternating rounds each (/work/notes/omp_policy.sh): default
106-115, PASSIVE 80-88, GOMP_SPINCOUNT=10000 91-102, 100000 101-111 tok/s.

`configure_waiting()` sets SPIN_COUNT unless the user chose a policy (OMP_WAIT_POLICY or
GOMP_SPINCOUNT in the environment). The CLI and the app call it first thing, before torch is
imported. Imports no torch.
"""

from __future__ import annotations

import os

SPIN_COUNT = "100000"


def configure_waiting() -> None:
    """A bounded spin for OpenMP's waiting threads, unless the environment already says."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
