"""Light and dark themes: the Fusion style with a palette, plus a small style sheet for the chat
(message bubbles, the error banner, the empty state). "system" follows the desktop's colour
scheme where Qt can read it (Qt 6.5+ `styleHints().colorScheme()`), else light."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from app.chat.markdown import DARK, LIGHT, MarkdownPalette


def is_dark(theme: str) -> bool:
    if theme == "dark":
        return True
    if theme == "light":
        return False
    hints = QGuiApplication.styleHints()
    return hints is not None and hints.colorScheme() == Qt.ColorScheme.Dark


def markdown_palette(theme: str) -> MarkdownPalette:
    return DARK if is_dark(theme) else LIGHT


def _dark_palette() -> QPalette:
    p = QPalette()
    base, window, text = QColor("#1e2227"), QColor("#25292f"), QColor("#e6edf3")
    p.setColor(QPalette.ColorRole.Window, window)
    p.setColor(QPalette.ColorRole.WindowText, text)
    p.setColor(QPalette.ColorRole.Base, base)
    p.setColor(QPalette.ColorRole.AlternateBase, window)
    p.setColor(QPalette.ColorRole.ToolTipBase, window)
    p.setColor(QPalette.ColorRole.ToolTipText, text)
    p.setColor(QPalette.ColorRole.Text, text)
    p.setColor(QPalette.ColorRole.Button, QColor("#30363d"))
    p.setColor(QPalette.ColorRole.ButtonText, text)
    p.setColor(QPalette.ColorRole.Link, QColor("#4493f8"))
    p.setColor(QPalette.ColorRole.Highlight, QColor("#1f6feb"))
    p.setColor(QPalette.ColorRole.HighlightedText, QColor("#ffffff"))
    p.setColor(QPalette.ColorRole.PlaceholderText, QColor("#8b949e"))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6e7681"))
    return p


def _light_palette() -> QPalette:
    p = QPalette()
    p.setColor(QPalette.ColorRole.Window, QColor("#f3f4f6"))
    p.setColor(QPalette.ColorRole.WindowText, QColor("#1f2328"))
    p.setColor(QPalette.ColorRole.Base, QColor("#ffffff"))
    p.setColor(QPalette.ColorRole.AlternateBase, QColor("#f6f8fa"))
    p.setColor(QPalette.ColorRole.Text, QColor("#1f2328"))
    p.setColor(QPalette.ColorRole.Button, QColor("#f6f8fa"))
    p.setColor(QPalette.ColorRole.ButtonText, QColor("#1f2328"))
    p.setColor(QPalette.ColorRole.Link, QColor("#0969da"))
    p.setColor(QPalette.ColorRole.Highlight, QColor("#0969da"))
    p.setColor(QPalette.ColorRole.HighlightedText, QColor("#ffffff"))
    p.setColor(QPalette.ColorRole.PlaceholderText, QColor("#6e7781"))
    return p


def style_sheet(dark: bool) -> str:
    user_bg, assistant_bg = ("#1f3a5f", "#2b3038") if dark else ("#dbeafe", "#ffffff")
    border = "#3d444d" if dark else "#d0d7de"
    banner_bg, banner_fg = ("#5c1d1d", "#ffd7d5") if dark else ("#ffebe9", "#82071e")
    muted = "#9198a1" if dark else "#656d76"
    focus = "#4493f8" if dark else "#0969da"
    selected, hover = ("#1f3a5f", "#2b3038") if dark else ("#dbeafe", "#eef1f4")
    text = "#e6edf3" if dark else "#1f2328"
    return f"""
    QFrame#message[role="user"] {{ background: {user_bg}; border-radius: 10px; }}
    QFrame#message[role="assistant"] {{ background: {assistant_bg}; border: 1px solid {border}; border-radius: 10px; }}
    QLabel#messageRole {{ color: {muted}; font-weight: bold; }}
    QLabel#messageNote {{ color: {muted}; }}
    QTextBrowser#messageBody {{ background: transparent; border: none; }}
    QFrame#thinking {{ border: none; border-left: 3px solid {border}; }}
    QToolButton#thinkingHeader {{ border: none; color: {muted}; padding: 2px 4px 2px 0px; }}
    QToolButton#thinkingHeader:hover {{ color: {text}; }}
    QTextBrowser#thinkingBody {{ background: transparent; border: none; color: {muted}; }}
    QToolButton#messageAction {{ border: none; color: {muted}; padding: 2px 6px; }}
    QToolButton#messageAction:hover {{ text-decoration: underline; }}
    QFrame#errorBanner {{ background: {banner_bg}; border-radius: 6px; }}
    QFrame#errorBanner QLabel {{ color: {banner_fg}; }}
    QLabel#emptyTitle {{ font-size: 18pt; font-weight: bold; }}
    QLabel#emptyText {{ color: {muted}; }}
    QLabel#statusField {{ padding: 0px 6px; }}
    QLineEdit, QPlainTextEdit {{ border: 1px solid {border}; border-radius: 5px; padding: 3px 5px; }}
    QLineEdit:focus, QPlainTextEdit:focus {{ border: 1px solid {focus}; }}
    QListWidget#conversationList {{ border: 1px solid {border}; border-radius: 5px; padding: 2px; }}
    QListWidget#conversationList::item {{ padding: 5px 4px; border-radius: 4px; }}
    QListWidget#conversationList::item:selected {{ background: {selected}; color: {text}; }}
    QListWidget#conversationList::item:hover:!selected {{ background: {hover}; }}
    QToolButton#messageAction {{ font-size: 9pt; }}
    """


def apply_theme(app: QApplication, theme: str, font_size: int = 11) -> bool:
    """Apply the theme to the whole app; returns True when it is dark."""
    dark = is_dark(theme)
    app.setStyle("Fusion")
    app.setPalette(_dark_palette() if dark else _light_palette())
    app.setStyleSheet(style_sheet(dark))
    font = QFont(app.font())
    font.setPointSize(max(7, font_size))
    app.setFont(font)
    return dark
