"""Keyboard mnemonics ("&Port:") that work, and none shown as a literal "&".

A QLabel draws "&" as an underline under the next letter only when it has a buddy, the widget
Alt+letter moves to; without one it draws the "&" itself. QFormLayout.addRow(text, widget)
gives the label its buddy, but addRow(text, layout) (a field with a button beside it) cannot, so
"API &key:" showed its ampersand. `give_buddies` walks a finished dialog and gives each such
label the first widget of its field that takes the keyboard focus; a label it cannot pair (not in
a form, or a field without a focusable widget) loses the "&" instead, so it never shows.
"""

from __future__ import annotations

import re

from PySide6 import QtGui
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFormLayout, QLabel, QLayout, QWidget

_MNEMONIC = re.compile(r"&(?!&)(?=\S)")  # "&k", not "&&" (a literal ampersand) nor a trailing "&"


def has_mnemonic(text: str) -> bool:
    """`text` marks a letter with "&" (a plain label's text: rich text has no mnemonics)."""
    return bool(_MNEMONIC.search(text.replace("&&", "")))


def _plain(label: QLabel) -> bool:
    fmt = label.textFormat()
    if fmt == Qt.TextFormat.RichText:
        return False
    return fmt == Qt.TextFormat.PlainText or not QtGui.Qt.mightBeRichText(label.text())


def _focusable(item: QWidget | QLayout | None) -> QWidget | None:
    """The first widget in `item` (a widget or a layout, searched in order) that takes focus."""
    if isinstance(item, QWidget):
        if item.focusPolicy() != Qt.FocusPolicy.NoFocus and not isinstance(item, QLabel):
            return item
        children = item.findChildren(QWidget)
        return next((w for w in children if w.focusPolicy() != Qt.FocusPolicy.NoFocus
                     and not isinstance(w, QLabel)), None)
    if isinstance(item, QLayout):
        for i in range(item.count()):
            child = item.itemAt(i)
            found = _focusable(child.widget() or child.layout()) if child is not None else None
            if found is not None:
                return found
    return None


def _field_of(label: QLabel) -> QWidget | QLayout | None:
    """The field beside `label` when it is a QFormLayout row's label."""
    parent = label.parentWidget()
    for form in parent.findChildren(QFormLayout) if parent is not None else ():
        for row in range(form.rowCount()):
            label_item = form.itemAt(row, QFormLayout.ItemRole.LabelRole)
            if label_item is not None and label_item.widget() is label:
                field = form.itemAt(row, QFormLayout.ItemRole.FieldRole)
                return None if field is None else field.widget() or field.layout()
    return None


def unpaired(root: QWidget) -> list[QLabel]:
    """The plain labels under `root` that mark a mnemonic but have no buddy (they show "&")."""
    return [label for label in root.findChildren(QLabel)
            if label.buddy() is None and _plain(label) and has_mnemonic(label.text())]


def give_buddies(root: QWidget) -> None:
    """Pair every unpaired mnemonic label under `root` with its form field's first focusable
    widget; drop the "&" of those that have none."""
    for label in unpaired(root):
        buddy = _focusable(_field_of(label))
        if buddy is not None:
            label.setBuddy(buddy)
        else:
            label.setText("&&".join(_MNEMONIC.sub("", part) for part in label.text().split("&&")))
