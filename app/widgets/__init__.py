"""Widgets and helpers every page uses.

- `status`: the status bar (model pair, placement, the answer's figures, load progress, the
  API server's field) and the error banner.
- `field_row`: eliding labels in one row that yield room in a set order.
- `dialogs`: the confirm and ask dialogs as injected callables (tests answer them without a
  window).
- `mnemonics`: Alt+letter shortcuts that work and never show a literal "&".

Contract: no engine work, no database; imports `state` only.
"""
