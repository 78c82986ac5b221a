"""The chat page and its parts.

- `turn`: the Qt-free turn controller: a conversation's history -> the request, the answer
  being written, and the save rule (what is written to the database when). Tested without a
  window.
- `page`: the layout and its wiring (sidebar, system prompt row, engine picker, view,
  composer) over the turn controller and the workers.
- `view` (+ `chunking`, `markdown`): the messages, rendered as they stream; `composer`,
  `sidebar`, `system_prompt`, `engine_picker`, `empty_state`; `turn_status`: the answer's
  figures in the status bar per conversation.

Contract: widgets read and write the database only through the turn controller and the
ConversationStore; the engine only through the workers' hosts. Imports `state`, `workers`,
`widgets`.
"""
