"""Markdown -> the HTML subset QTextBrowser renders well.

markdown-it-py (CommonMark + tables + strikethrough) parses; code blocks are highlighted by
Pygments with inline styles (Qt's rich text has no CSS classes worth relying on) and drawn as a
one-cell table with a background, a language label and a "Copy" link
(`copy:<block index>`; the view handles it via anchorClicked). Tables get borders and padding
as attributes, which Qt honours, rather than CSS it ignores. An unclosed fence (an answer still
streaming) renders as a code block up to the end, so streaming never flickers between styles.

Nothing here imports Qt widgets; `render` is a pure function of (text, palette).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererProtocol
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

MONO = "'DejaVu Sans Mono', 'Cascadia Mono', Menlo, Consolas, monospace"


@dataclass(frozen=True)
class MarkdownPalette:
    """Colours the renderer needs, light or dark."""

    dark: bool
    text: str
    code_background: str
    code_border: str
    inline_code_background: str
    muted: str
    link: str
    table_header: str

    @property
    def pygments_style(self) -> str:
        return "monokai" if self.dark else "friendly"


LIGHT = MarkdownPalette(False, "#1f2328", "#f6f8fa", "#e3e7eb", "#eff1f3", "#57606a", "#0969da", "#f0f3f6")
DARK = MarkdownPalette(True, "#e6edf3", "#272822", "#3a3d35", "#2d333b", "#a8b0b8", "#6cb6ff", "#2d333b")


@lru_cache(maxsize=1)
def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "breaks": False})
    md.enable(["table", "strikethrough"])

    def code(renderer: RendererProtocol, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType) -> str:
        tok = tokens[idx]
        lang = (tok.info or "").strip().split(" ")[0] if tok.type == "fence" else ""
        index = env["blocks"]
        env["blocks"] = index + 1
        # a block cut between two pieces of a streaming answer (app.chat.chunking) is drawn as one:
        # the continuation has no header, and neither half has a margin at the seam
        head = not (index == 0 and env["continued"])
        last = env["continues"] and not any(t.type in ("fence", "code_block") for t in tokens[idx + 1 :])
        return _code_block_html(tok.content, lang, index, env["palette"], head, not last)

    md.add_render_rule("fence", code)
    md.add_render_rule("code_block", code)
    return md


@lru_cache(maxsize=8)
def _formatter(style: str) -> HtmlFormatter:
    return HtmlFormatter(noclasses=True, nowrap=True, style=style)


def _lexer(lang: str) -> Lexer:
    # No guessing for unlabelled blocks: guess_lexer tries every lexer (~0.1-0.8 s a block).
    if lang:
        try:
            return get_lexer_by_name(lang, stripnl=False)
        except ClassNotFound:
            pass
    return TextLexer(stripnl=False)


@lru_cache(maxsize=256)
def highlight_code(code: str, lang: str, palette: MarkdownPalette) -> str:
    """Pygments spans with inline colours; newlines kept (the caller wraps them in <pre>).
    Cached: while an answer streams, its finished code blocks are re-rendered unchanged."""
    body = highlight(code, _lexer(lang), _formatter(palette.pygments_style))
    return body.rstrip("\n")


def warm_up_highlighting() -> None:
    """Import Pygments' lexers for common languages and its styles (~0.1 s on first use) so the
    first code block of a streaming answer does not stall the GUI; run in a background thread."""
    for lang in ("python", "bash", "javascript", "json", "c", "cpp", "rust", "html", "sql"):
        _lexer(lang)
    for palette in (LIGHT, DARK):  # own formatters: the cached ones belong to the GUI thread
        highlight("x = 1", _lexer("python"), HtmlFormatter(noclasses=True, nowrap=True, style=palette.pygments_style))


def code_blocks(text: str) -> list[str]:
    """The fenced and indented code blocks of `text`, in order (what the Copy links copy)."""
    return [t.content for t in _parser().parse(text) if t.type in ("fence", "code_block")]


def render(text: str, palette: MarkdownPalette = LIGHT, continued: bool = False, continues: bool = False) -> str:
    """HTML for a QTextBrowser/QTextDocument; code block i links to `copy:i`. `continued`: the
    first code block goes on from the previous piece; `continues`: the last goes on in the next."""
    md = _parser()
    env = {"blocks": 0, "palette": palette, "continued": continued, "continues": continues}
    body = md.renderer.render(md.parse(text), md.options, env)
    body = _style_tables(body, palette)
    body = body.replace("<code>", f"<code style=\"font-family: {MONO}; background-color: "
                                  f"{palette.inline_code_background};\">")
    body = body.replace("<blockquote>", f'<blockquote style="color: {palette.muted}; font-style: italic;">')
    return f'<div style="color: {palette.text};">{body}</div>'


def _code_block_html(code: str, lang: str, index: int, p: MarkdownPalette, head: bool = True,
                     tail: bool = True) -> str:
    # Qt draws a bordered table's cell borders too, so the block is borderless: a header row in
    # the border colour (language, Copy on the right) over the code on the code background.
    label = html.escape(lang or "code")
    highlighted = highlight_code(code.rstrip("\n"), lang, p) or "&nbsp;"
    header = (
        f'<tr><td bgcolor="{p.code_border}" style="color: {p.muted}; font-size: small;">{label}</td>'
        f'<td bgcolor="{p.code_border}" align="right" style="font-size: small;"><a href="copy:{index}" '
        f'style="color: {p.link}; text-decoration: none;">Copy</a></td></tr>') if head else ""
    return (
        f'<table width="100%" cellspacing="0" cellpadding="6" border="0" bgcolor="{p.code_background}" '
        f'style="margin-top: {6 if head else 0}px; margin-bottom: {10 if tail else 0}px;">{header}'
        f'<tr><td colspan="2"><pre style="font-family: {MONO}; margin: 0px; white-space: pre-wrap;">'
        f"{highlighted}</pre></td></tr></table>\n"
    )


def _style_tables(body: str, p: MarkdownPalette) -> str:
    if "<table>" not in body:
        return body
    body = body.replace(
        "<table>",
        f'<table border="1" cellspacing="0" cellpadding="5" style="border-color: {p.code_border}; '
        f'border-collapse: collapse; margin-top: 4px; margin-bottom: 8px;">',
    )
    body = body.replace("<th>", f'<th style="background-color: {p.table_header};">')
    return body.replace('<th style="text-align:', f'<th style="background-color: {p.table_header}; text-align:')
