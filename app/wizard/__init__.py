"""The first-run wizard: welcome -> benchmark -> recommended pair -> download -> test run.

`first_run.FirstRunWizard` holds the pages and the choice; `runs` the two measuring pages.
Contract: it saves the chosen pair and `first_run_done` on finish, nothing before; slow steps
run in `workers`. Imports `state`, `workers`, `widgets`, `models`.
"""
