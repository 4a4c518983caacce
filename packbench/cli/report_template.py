"""The report's page: one self-contained HTML document (styles inline, plots inline SVG).

The Content-Security-Policy forbids every fetch (no scripts, fonts, images or styles from
anywhere but the page itself and data: URLs), so a report that tried to reach the network
would show a console error, which the browser test refuses.
"""

from string import Template

CSS = """
:root { --ok: #1a7f37; --fail: #cf222e; --muted: #57606a; --line: #d0d7de; }
* { box-sizing: border-box; }
body { font: 14px/1.45 "DejaVu Sans", system-ui, sans-serif; color: #1f2328; margin: 0 auto; padding: 1.5rem;
       max-width: 1100px; }
h1 { font-size: 1.5rem; margin: 0 0 .25rem; overflow-wrap: anywhere; }
h2 { font-size: 1.15rem; border-bottom: 1px solid var(--line); padding-bottom: .2rem; margin-top: 2rem; }
h3 { font-size: 1rem; margin: 1.2rem 0 .3rem; }
p.lede { color: var(--muted); margin: 0 0 1rem; overflow-wrap: anywhere; }
code, .mono { font-family: "DejaVu Sans Mono", ui-monospace, monospace; font-size: 12px; word-break: break-all; }
div.scroll { overflow-x: auto; max-width: 100%; }
table.conditions { font-size: 12.5px; }
table.conditions th, table.conditions td { padding: .25rem .4rem; }
table.conditions th { min-width: 4.5em; }
table.conditions td.wrap { min-width: 8em; }
table.conditions td .detail { font-size: 11px; }
table { border-collapse: collapse; margin: .4rem 0 1rem; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: .25rem .6rem; text-align: left; vertical-align: top; }
th { background: #f6f8fa; font-weight: 600; }
td { white-space: nowrap; }
td.detail, td.wrap { white-space: normal; }
td.name { white-space: normal; min-width: 7em; max-width: 12em; overflow-wrap: anywhere; }
td.name.short { white-space: nowrap; max-width: none; }
td.mono { white-space: normal; word-break: break-all; min-width: 12em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.pass { color: var(--ok); font-weight: 700; }
.fail { color: var(--fail); font-weight: 700; }
.none { color: var(--muted); }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(300px, 1fr)); gap: 0 2rem; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .15rem .8rem; margin: .3rem 0 1rem; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; }
figure.plot { margin: .5rem 0 1.5rem; }
figure.plot svg.chart { width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 12px; margin-top: .2rem; }
p.missing { color: var(--muted); font-style: italic; }
.detail { color: var(--muted); font-size: 12px; }
ul.problems { color: var(--fail); }
footer { color: var(--muted); font-size: 12px; margin-top: 3rem; border-top: 1px solid var(--line);
         padding-top: .5rem; }
@media print { body { max-width: none; } figure.plot { break-inside: avoid; } }
"""

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="packbench $version">
<title>$title</title>
<style>$css</style>
</head>
<body>
<header>
<h1>$title</h1>
<p class="lede">$lede</p>
</header>
$body
<footer>Written by packbench $version from the raw archive$plural named above; every number is derived from
its records (docs/report.md). Plots are static SVG drawn by matplotlib $mpl.</footer>
</body>
</html>
""")
