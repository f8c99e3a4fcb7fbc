"""The memory viewer's inline style sheet (:mod:`jaxmem._src.profile.html` writes it).

Plain CSS for the page :mod:`jaxmem._src.profile.html_script` draws: a light page of white
boxes, cards for the totals, the SVG charts, tables and the tooltip. System fonts only (nothing
is fetched). The text holds no ``</style>``.
"""

STYLE = r"""
:root {
  --bg: #f5f6f8; --panel: #ffffff; --ink: #1d2330; --muted: #667085; --line: #e3e6eb;
  --accent: #3056d3; --accent-soft: rgba(48, 86, 211, 0.10); --good: #1a7f37; --bad: #c4320a;
  --mono: "DejaVu Sans Mono", Menlo, Consolas, "Liberation Mono", monospace;
}
* { box-sizing: border-box; }
html { background: var(--bg); }
body {
  margin: 0; padding: 22px 28px 40px; color: var(--ink); font-size: 13.5px; line-height: 1.45;
  font-family: "Segoe UI", Roboto, "Helvetica Neue", Arial, "Liberation Sans", system-ui,
    sans-serif;
}
code, .mono { font-family: var(--mono); font-size: 0.92em; }
h1, h2, h3 { margin: 0; font-weight: 600; letter-spacing: -0.01em; }
h1 { font-size: 22px; } h2 { font-size: 18px; } h3 { font-size: 14px; }
.eyebrow {
  text-transform: uppercase; letter-spacing: 0.08em; font-size: 11px; color: var(--accent);
  font-weight: 600; margin-bottom: 2px;
}
.meta { color: var(--muted); margin: 4px 0 0; }
.muted { color: var(--muted); }
.page-head { margin-bottom: 16px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin-top: 14px; }
.card {
  background: var(--panel); border: 1px solid var(--line); border-radius: 10px;
  padding: 10px 14px; min-width: 150px; flex: 0 1 auto;
}
.card.peak { border-color: #f0b4a4; background: #fff8f6; }
.card-label { font-size: 11.5px; color: var(--muted); text-transform: uppercase;
  letter-spacing: 0.05em; }
.card-value { font-size: 20px; font-weight: 650; margin-top: 1px; }
.card-note { font-size: 11.5px; color: var(--muted); max-width: 260px; }
.compact .cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(105px, 1fr));
  gap: 8px; }
.compact .card { min-width: 0; padding: 7px 10px; }
.compact .card-note { display: none; }
.compact .card-value { font-size: 16px; }
.box {
  background: var(--panel); border: 1px solid var(--line); border-radius: 10px;
  padding: 12px 14px; margin-bottom: 14px;
}
.box-head { display: flex; align-items: baseline; gap: 12px; margin-bottom: 6px;
  flex-wrap: wrap; }
.hint { color: var(--muted); font-size: 12px; }
.report-body { display: grid; grid-template-columns: minmax(0, 1fr) 360px; gap: 14px;
  align-items: start; }
.compact .report-body { grid-template-columns: minmax(0, 1fr); }
.side-col { position: sticky; top: 12px; }
.compact .side-col { position: static; }
.chart svg, .lanes svg { display: block; width: 100%; }
svg text { font-family: inherit; fill: #4a5363; font-size: 11px; }
svg .axis-title { fill: var(--muted); font-size: 11px; }
svg .grid { stroke: #eceef2; }
svg .axis { stroke: #aab1bd; }
svg .band { transition: opacity 0.12s; }
svg .dim { opacity: 0.28; }
svg .total { fill: none; stroke: #2b3140; stroke-width: 1.1; }
svg .peak-line { stroke: #c4320a; stroke-dasharray: 4 3; stroke-width: 1.2; }
svg .peak-dot { fill: #c4320a; }
svg .peak-label { fill: #c4320a; font-weight: 600; font-size: 11.5px; }
svg .cursor { stroke: #1d2330; stroke-width: 1; opacity: 0.55; pointer-events: none; }
svg .sel-span { fill: rgba(48, 86, 211, 0.07); pointer-events: none; }
svg .sel-edge { stroke: var(--accent); stroke-width: 1.2; opacity: 0.8; pointer-events: none; }
svg .sel-label { fill: var(--accent); font-weight: 600; }
svg .lane { cursor: pointer; }
svg .lane:hover { filter: brightness(0.9); }
svg .lane.selected { stroke: #111827; stroke-width: 1.6; }
svg .lane-label { font-family: var(--mono); font-size: 10.5px; pointer-events: none; }
svg .hit { cursor: crosshair; }
svg .brush { fill: rgba(48, 86, 211, 0.16); stroke: var(--accent); pointer-events: none; }
.zoom-out { margin-left: auto; font: inherit; font-size: 12px; color: var(--accent);
  background: var(--accent-soft); border: 1px solid rgba(48, 86, 211, 0.3); border-radius: 6px;
  padding: 2px 9px; cursor: pointer; }
.legend { list-style: none; padding: 0; margin: 8px 0 0; display: flex; flex-wrap: wrap;
  gap: 4px 14px; }
.legend li { display: flex; align-items: center; gap: 6px; cursor: default; font-size: 12.5px; }
.legend li b { font-weight: 600; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 3px;
  flex: none; }
.detail h3 { display: flex; align-items: center; gap: 8px; flex-wrap: wrap; }
.detail h3 code { font-size: 14px; }
.detail-size { font-size: 20px; font-weight: 650; margin: 6px 0 8px; }
.detail-size .muted { font-size: 12px; font-weight: 400; }
.detail dl { display: grid; grid-template-columns: 92px minmax(0, 1fr); gap: 5px 10px;
  margin: 0; }
.detail dt { color: var(--muted); }
.detail dd { margin: 0; overflow-wrap: anywhere; }
.detail .path { font-size: 11.5px; }
.detail .missing { color: var(--bad); }
.range { position: relative; height: 8px; background: #eef0f4; border-radius: 4px;
  margin: 10px 0 2px; }
.range span { position: absolute; top: 0; bottom: 0; border-radius: 4px; }
.range i { position: absolute; top: -3px; bottom: -3px; width: 2px; background: #c4320a; }
.badge { font-size: 11px; font-weight: 600; padding: 1px 7px; border-radius: 999px;
  background: #eef0f4; color: #3b4252; }
.badge.temp { background: #e8edfb; color: #2947b8; }
.badge.argument { background: #e7f5ec; color: #1a7f37; }
.badge.output { background: #fdf1e3; color: #9a5b00; }
.badge.backward { background: #fbe9e7; color: #b4321a; }
table.data { border-collapse: collapse; width: 100%; font-size: 12.5px; }
table.data th { text-align: left; font-weight: 600; color: var(--muted); font-size: 11.5px;
  text-transform: uppercase; letter-spacing: 0.04em; border-bottom: 1px solid var(--line);
  padding: 6px 8px; white-space: nowrap; }
table.data td { padding: 5px 8px; border-bottom: 1px solid #f0f1f4; vertical-align: top; }
table.data td.num, table.data th.num { text-align: right; white-space: nowrap;
  font-variant-numeric: tabular-nums; }
table.data tbody tr[data-buffer] { cursor: pointer; }
table.data tbody tr:hover { background: #f7f8fb; }
table.data tbody tr.selected { background: var(--accent-soft); }
table.data td.src { max-width: 320px; }
table.data td.nowrap { white-space: nowrap; }
table.data td.op { max-width: 360px; overflow-wrap: anywhere; color: #4a5363; }
.share { display: flex; align-items: center; gap: 8px; min-width: 150px; }
.share-bar { height: 8px; border-radius: 4px; background: #eef0f4; flex: 1; position: relative; }
.share-bar span { position: absolute; left: 0; top: 0; bottom: 0; border-radius: 4px; }
.tools { display: flex; gap: 14px; align-items: center; margin: 2px 0 8px; flex-wrap: wrap; }
.tools input[type=search] { font: inherit; padding: 5px 9px; border: 1px solid var(--line);
  border-radius: 7px; width: 340px; max-width: 100%; }
.table-scroll { overflow-x: auto; }
.ratio { font-size: 11.5px; margin-left: 4px; color: var(--muted); }
.ratio.better { color: var(--good); } .ratio.worse { color: var(--bad); }
.compare-grid { display: grid; gap: 18px; align-items: start; }
.compare-grid > .report { min-width: 0; }
.report-title { display: flex; align-items: baseline; gap: 10px; }
.linkish { background: none; border: 0; padding: 0; font: inherit; color: var(--accent);
  cursor: pointer; font-weight: 600; }
.tooltip {
  position: fixed; z-index: 10; pointer-events: none; background: #ffffff; color: var(--ink);
  border: 1px solid #d5d9e0; border-radius: 8px; box-shadow: 0 6px 20px rgba(16, 24, 40, 0.14);
  padding: 8px 10px; font-size: 12px; max-width: 440px;
}
.tooltip .tt-head { font-weight: 600; margin-bottom: 4px; }
.tooltip table { border-collapse: collapse; }
.tooltip td { padding: 1px 6px 1px 0; vertical-align: middle; }
.tooltip td.num { text-align: right; font-variant-numeric: tabular-nums; }
.tooltip tr.hot td { font-weight: 650; }
.tooltip .tt-foot { color: var(--muted); margin-top: 4px; }
.note { background: #fff8e6; border: 1px solid #f2dfa8; border-radius: 8px; padding: 8px 12px; }
.viewer-error { background: #fdecea; border: 1px solid #f5b5ad; color: #8a1c0b;
  border-radius: 8px; padding: 10px 14px; margin-bottom: 12px; }
"""
