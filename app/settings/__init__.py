"""The settings dialog and its tabs.

`dialog.SettingsDialog` edits a copy of the preferences; OK saves it. Each tab is its own
module with `show_preferences(prefs)` and `values()` (the fields it owns): sampling, engine,
appearance, prompts, this computer (benchmark and the budget plot: `plot`, `plot_entries`),
server, engines, Hugging Face. `tips` holds the fields' tooltips.

Contract: nothing is saved before OK; slow work (benchmark, listing a server's models) runs in
`workers`. Imports `state`, `workers`, `widgets`, `models` (the predictions).
"""
