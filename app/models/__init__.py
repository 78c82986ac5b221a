"""The models page and its parts.

- `page.ModelsPage`: the page, composed of `pair_box` (the active pair), `catalog_tab` (pairs
  with their fit and speed), `local_tab` (models on this computer, LM Studio's and Ollama's,
  damaged ones marked; import and remove) and `downloads` (the download queue's rows).
- `recommend`: which catalog pairs suit this machine (fit, measured or predicted speed,
  download warnings), as plain rows; `tables`: those rows into QTableWidgets.

Contract: slow work runs in `workers` (downloads, the disk scan); confirmations and file
choosers are injected (`widgets.dialogs`). Imports `state`, `workers`, `widgets`.
"""
