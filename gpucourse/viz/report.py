"""Figures in one HTML file that opens from disk, offline: plotly.js is written into it once, inline."""

from __future__ import annotations

import html

from .style import PLOTLY_CONFIG

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align: left; }
td.bad { color: #C00; font-weight: bold; }
section.figure { margin: 2.5em 0; }
p.note { color: #555; max-width: 60em; }
"""


def table_html(header: list[str], rows: list[list[str]], bad_column: int | None = None, bad_values=()) -> str:
    """A plain HTML table; cells of ``bad_column`` whose text is in ``bad_values`` are marked."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            attr = ' class="bad"' if i == bad_column and cell in bad_values else ""
            cells.append(f"<td{attr}>{html.escape(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def html_report(title: str, intro_html: str, figures: list[tuple[str, str, str, object]]) -> str:
    """One self-contained page: ``intro_html``, then each ``(id, heading, note, figure)`` as a section."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    sections = []
    for fig_id, heading, note, fig in figures:
        div = pio.to_html(fig, full_html=False, include_plotlyjs=False, config=PLOTLY_CONFIG, auto_play=False,
                          div_id=f"plot-{fig_id}")
        sections.append(f'<section class="figure" id="{html.escape(fig_id)}"><h2>{html.escape(heading)}</h2>'
                        f'<p class="note">{html.escape(note)}</p>{div}</section>')
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style>"
            # What plotly's own to_html writes before an inline plotly.js: no MathJax from a CDN.
            f"<script type=\"text/javascript\">window.PlotlyConfig = {{MathJaxConfig: 'local'}};</script>"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>"
            f"<body><h1>{html.escape(title)}</h1>{intro_html}{''.join(sections)}</body></html>\n")
