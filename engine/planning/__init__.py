"""What this machine can do and what to ask of it: the hardware profile, the placement of a
target's layers, and the cost model that picks the tree budget.

Contract: everything here takes plain data (HardwareProfile, ModelShape, Placement, a
PassRecord of an engine's recorded passes), never a loaded model or the Engine, so it runs for
models that are not loaded (the models page, `bench plan`) exactly as for a loaded pair.
profile.py is the saved profile, measure.py measures one (torch), reference.py builds one from
datasheets, placement.py splits layers over GPU/RAM/disk, calibration.py fits the acceptance
curve, planner.py prices budgets and chooses (`plan_for_pair`, `predict_pair`).

What it does not do: load or run models, or change settings by itself (callers apply a Plan).
"""
