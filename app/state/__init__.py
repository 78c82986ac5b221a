"""What the app knows and keeps, as plain data and stores.

- `preferences`: the user's settings (a frozen dataclass) and their QSettings store; it turns
  them into the engine's settings (budget "auto" is the engine's budget 0).
- `conversations` (+ `recovery`): conversations and messages in SQLite; a damaged, unwritable
  or newer file never keeps the app from opening (its `notice` says what happened).
- `remote_engines`: the servers of Settings > Engines and a conversation's engine choice.
- `running`: what the engine has loaded, described from it; `names`: a model or path in a word.
- `logfile`: the rotating log file every error banner names.

Contract: no widgets and no threads; everything here runs on whichever thread calls it
(conversations: the GUI thread's one connection). Imports nothing else of the app.
"""
