/*
 * The memory viewer's script, written inline by jaxmem/_src/profile/html.py.
 *
 * Vanilla JavaScript (no library, nothing fetched). This script reads the page's JSON data
 * block (``id="jaxmem-data"``) and draws, for each report: cards with the totals, the live bytes
 * over the program stacked by source line as inline SVG (peak marked; hover for what is live at a
 * point, click to open the largest buffer of a band there, drag to zoom, double-click to zoom
 * out), the live ranges of the largest buffers live at the peak, a buffer's details, the top
 * contributors and a filterable table of every buffer; a comparison adds, for the baseline and
 * each other report, what each peak holds source by source (added, freed, common). A buffer is
 * named by what it is attributed to (its ``label``, computed in Python: the model's line or the
 * argument's pytree path, as the legend spells it); XLA's name of the value is secondary. A
 * source line has one colour on the whole page. ``#buffer=NAME`` (and
 * ``#report=LABEL&buffer=NAME``) in the address opens that buffer's details on load; NAME is
 * XLA's name. When done it sets ``data-viewer="ready"`` on ``<html>``.
 */
(function () {
"use strict";
const DATA = JSON.parse(document.getElementById("jaxmem-data").textContent);
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#bcbd22", "#17becf", "#7f7f7f"];
const OTHER_COLOR = "#c3c7cf";
const COMPACT = DATA.kind === "comparison";
const PALETTE = new Map();  // band label -> colour, the same in every report of the page
function colorOf(label) {
  if (label === "other") return OTHER_COLOR;
  if (!PALETTE.has(label)) PALETTE.set(label, COLORS[PALETTE.size % COLORS.length]);
  return PALETTE.get(label);
}
function inkOn(hex) {
  const n = parseInt(hex.slice(1), 16);
  const lum = (0.299 * (n >> 16) + 0.587 * ((n >> 8) & 255) + 0.114 * (n & 255)) / 255;
  return lum > 0.62 ? "#1d2330" : "#ffffff";
}
const LANES = COMPACT ? 12 : 16;

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => (
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function fmtBytes(n) {
  if (n === null || n === undefined) return "n/a";
  let size = n;
  for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
    if (Math.abs(size) < 1024 || unit === "TiB") {
      return unit === "B" ? Math.trunc(size) + " B" : size.toFixed(2) + " " + unit;
    }
    size /= 1024;
  }
}
function fmtInt(n) { return Number(n).toLocaleString("en-US"); }
function fmtShape(b) { return b.dtype + "[" + b.shape.join(", ") + "]"; }
function unitFor(x) {
  for (const [p, u] of [[3, "GiB"], [2, "MiB"], [1, "KiB"]]) {
    if (x >= 1024 ** p) return [1024 ** p, u];
  }
  return [1, "bytes"];
}
function niceStep(range, ticks) {
  const raw = Math.max(range, 1e-9) / ticks;
  const mag = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
  return 10 * mag;
}
function r1(v) { return Math.round(v * 10) / 10; }
function el(html) {
  const t = document.createElement("template");
  t.innerHTML = html.trim();
  return t.content.firstElementChild;
}

const tooltip = document.createElement("div");
tooltip.className = "tooltip";
tooltip.hidden = true;
document.body.appendChild(tooltip);
function showTip(html, event) {
  tooltip.innerHTML = html;
  tooltip.hidden = false;
  const w = tooltip.offsetWidth, h = tooltip.offsetHeight;
  let left = event.clientX + 16, top = event.clientY + 14;
  if (left + w > window.innerWidth - 8) left = event.clientX - w - 16;
  if (top + h > window.innerHeight - 8) top = Math.max(8, window.innerHeight - h - 8);
  tooltip.style.left = Math.max(8, left) + "px";
  tooltip.style.top = top + "px";
}
function hideTip() { tooltip.hidden = true; }

class Report {
  constructor(view, index) {
    this.v = view;
    this.index = index;
    this.t = view.timeline;
    this.byName = new Map();
    this.selected = null;
    this.missing = null;
    this.hotBand = null;
    if (this.t) {
      for (const b of this.t.buffers) if (!this.byName.has(b.name)) this.byName.set(b.name, b);
      this.peakSet = new Set(this.t.peak_buffers);
      this.points = this.t.timeline.length;
    }
  }
  color(band) {
    if (band === null || band === undefined) return OTHER_COLOR;
    return band === this.t.bands.length - 1 ? OTHER_COLOR : colorOf(this.t.bands[band].label);
  }
  instr(point) {
    return point < this.t.program.length ? this.t.program[point] : "<end>";
  }
  holders(point) {
    const held = new Map();
    for (const b of this.t.buffers) {
      if (b.band === null || b.start > point || b.end < point) continue;
      const key = b.allocation + ":" + b.offset;
      const cur = held.get(key);
      if (!cur || b.start > cur.start || (b.start === cur.start && b.bytes > cur.bytes)) {
        held.set(key, b);
      }
    }
    return [...held.values()].sort((a, b) => b.bytes - a.bytes || (a.name < b.name ? -1 : 1));
  }

  // ---- layout ------------------------------------------------------------------------------
  render(yMax) {
    this.yMax = yMax;
    const v = this.v;
    const head = COMPACT
      ? `<div class="report-title"><h2>${esc(v.name)}</h2>
           ${v.note ? `<span class="muted">${esc(v.note)}</span>` : ""}</div>`
      : `<div class="eyebrow">jaxmem memory report</div>
         <h1>Memory of <code>${esc(v.name)}</code></h1>`;
    const meta = this.t
      ? `XLA module <code>${esc(this.t.module)}</code> · ${fmtInt(this.t.program.length)}
         instructions in program order · ${fmtInt(this.t.buffers.length)} buffers ·
         jax ${esc(this.t.jax_version)}${v.note && !COMPACT ? " · " + esc(v.note) : ""}`
      : (v.note && !COMPACT ? esc(v.note) : "");
    this.root = el(`<section class="report${COMPACT ? " compact" : ""}"
        id="report-${this.index}" data-report="${esc(v.name)}">
      <header class="${COMPACT ? "" : "page-head"}">${head}
        ${meta ? `<p class="meta">${meta}</p>` : ""}
        <div class="cards">${this.cards()}</div>
      </header></section>`);
    if (!this.t) {
      this.root.appendChild(el(`<div class="box note">No buffer-level view of this report:
        ${esc(v.buffer_error || "not computed")}. The totals above come from XLA's memory
        analysis.</div>`));
      return this.root;
    }
    this.root.appendChild(el(`<div class="report-body">
      <div class="main-col">
        <section class="box">
          <div class="box-head"><h3>Live device memory over the program</h3>
            <span class="hint">stacked by what holds the peak · hover: what is live ·
              click: inspect · drag: zoom</span>
            <button class="zoom-out" data-role="zoom-out" hidden>show the whole program</button>
          </div>
          <div class="chart" data-role="chart"></div>
          <ul class="legend" data-role="legend">${this.legend()}</ul>
        </section>
        <section class="box">
          <div class="box-head"><h3>Live ranges of the largest buffers live at the peak</h3>
            <span class="hint">${Math.min(LANES, this.t.peak_buffers.length)} of
              ${this.t.peak_buffers.length} · click a bar for details</span></div>
          <div class="lanes" data-role="lanes"></div>
        </section>
      </div>
      <aside class="side-col">
        <section class="box detail" data-role="detail" id="detail-${this.index}"></section>
      </aside></div>`));
    this.root.appendChild(el(`<section class="box">
        <div class="box-head"><h3>Top contributors at the peak</h3>
          <span class="hint">buffers live at the peak, grouped by source line</span></div>
        <div class="table-scroll">${this.contributors()}</div></section>`));
    this.root.appendChild(el(`<section class="box">
        <div class="box-head"><h3>Buffers</h3><span class="hint">XLA's buffer assignment:
          every value placed in memory, with its live range in program points</span></div>
        <div class="tools">
          <input type="search" data-role="filter" placeholder="Filter: source, argument,
            name, shape, op_name" aria-label="Filter buffers">
          <label><input type="checkbox" data-role="all"> all ${fmtInt(this.t.buffers.length)}
            buffers, not only the ${this.t.peak_buffers.length} live at the peak</label>
        </div>
        <div class="table-scroll">${this.bufferTable()}</div></section>`));
    this.chartEl = this.root.querySelector("[data-role=chart]");
    this.lanesEl = this.root.querySelector("[data-role=lanes]");
    this.detailEl = this.root.querySelector("[data-role=detail]");
    this.zoomOut = this.root.querySelector("[data-role=zoom-out]");
    this.wire();
    return this.root;
  }

  cards() {
    const v = this.v, f = v.figures, t = this.t;
    const card = (label, value, note, cls) => `<div class="card ${cls || ""}">
      <div class="card-label">${label}</div><div class="card-value">${value}</div>
      ${note ? `<div class="card-note">${note}</div>` : ""}</div>`;
    const source = v.peak_source === "backend" ? "the backend's estimate" : "from live ranges";
    const where = t ? `at point ${fmtInt(t.peak_index)} of ${fmtInt(t.program.length)},
      in <code>${esc(t.peak_instruction)}</code> · ` : "";
    const out = [card("Peak", fmtBytes(v.peak_bytes), where + source, "peak"),
      card("Temp", fmtBytes(f.temp_bytes), "scratch: activations, residuals, loop buffers"),
      card("Arguments", fmtBytes(f.argument_bytes), "the inputs"),
      card("Outputs", fmtBytes(f.output_bytes), f.alias_bytes
        ? fmtBytes(f.alias_bytes) + " of them in donated arguments" : "the results")];
    const lead = t && t.top_contributors[0];
    if (lead && !COMPACT) {
      out.push(card("Top source line at the peak", fmtBytes(lead.bytes), `${esc(lead.label)} ·
        ${lead.count} buffer${lead.count === 1 ? "" : "s"}`));
    }
    if (v.residual_bytes !== null && v.residual_bytes !== undefined) {
      out.push(card("Residuals", fmtBytes(v.residual_bytes), "saved for the gradient"));
    }
    const host = f.host_temp_bytes + f.host_argument_bytes + f.host_output_bytes;
    if (host || (t && t.host_peak_bytes)) {
      out.push(card("Host memory", fmtBytes(t ? t.host_peak_bytes : host),
        "peak of offloaded values"));
    }
    return out.join("");
  }

  legend() {
    const t = this.t, last = t.bands.length - 1;
    const empty = t.layers[last].every((v) => v === 0);
    const fold = `<li class="fold" data-fold="${esc(t.fold)}">${esc(t.fold_note)}:</li>`;
    return fold + t.bands.map((b, i) => i === last && empty ? "" : `<li data-band="${i}"
      data-bytes="${b.bytes}" title="${esc(b.key || b.label)}">
      <span class="swatch" style="background:${this.color(i)}"></span>
      <span class="band-label">${esc(b.label)}</span> <b>${fmtBytes(b.bytes)}</b></li>`)
      .join("");
  }

  contributors() {
    const t = this.t, peak = t.peak_bytes || 1;
    const rows = t.top_contributors.map((g, i) => {
      const share = 100 * g.bytes / peak;
      const color = this.color(g.band);
      return `<tr data-buffer="${esc(g.names[0] || "")}" title="${esc(g.key)}">
        <td class="num">${i + 1}</td>
        <td class="src"><span class="swatch" style="background:${color}"></span>
          ${esc(g.label)}</td>
        <td>${g.backward ? '<span class="badge backward">backward</span>' : "forward"}</td>
        <td class="num">${g.count}</td><td class="num">${fmtBytes(g.bytes)}</td>
        <td><div class="share"><div class="share-bar"><span style="width:${share.toFixed(1)}%;
          background:${color}"></span></div><span class="num">${share.toFixed(1)}%</span></div>
        </td></tr>`;
    });
    return `<table class="data contributors"><thead><tr><th class="num">#</th>
      <th>source line</th><th>pass</th><th class="num">buffers</th><th class="num">size</th>
      <th>share of the peak</th></tr></thead><tbody>${rows.join("")}</tbody></table>`;
  }

  bufferTable() {
    const t = this.t;
    const order = [...t.buffers].sort((a, b) => (this.peakSet.has(b.name) -
      this.peakSet.has(a.name)) || b.bytes - a.bytes || (a.name < b.name ? -1 : 1));
    const rows = order.map((b) => {
      const peak = this.peakSet.has(b.name);
      const range = b.start === null ? "—" : `${b.start}–${b.end}`;
      const kind = b.kind + (b.loop_state ? " (loop)" : "") +
        (b.memory_space ? ` (space ${b.memory_space})` : "");
      const op = COMPACT ? "" : `<td class="op"><code>${esc(b.op_name || "—")}</code></td>`;
      const text = [b.label, b.name, fmtShape(b), b.kind, b.source, b.op_name].join(" ")
        .toLowerCase();
      return `<tr data-buffer="${esc(b.name)}" data-peak="${peak ? 1 : 0}"
          data-text="${esc(text)}" tabindex="0"${peak ? "" : " hidden"}>
        <td class="nowrap xla-name"><span class="swatch"
          style="background:${this.color(b.band)}"></span><code>${esc(b.name)}</code></td>
        <td class="num">${fmtBytes(b.bytes)}</td>
        <td class="nowrap"><code>${esc(fmtShape(b))}</code></td>
        <td class="nowrap">${esc(kind)}</td>
        <td class="src" data-role="label" title="${esc(b.source || b.argument)}">${
          esc(b.label)}</td>
        ${op}<td class="num">${range}</td></tr>`;
    });
    return `<table class="data buffers"><thead><tr>
      <th title="the HLO value of XLA's buffer assignment">XLA's name</th><th class="num">size</th>
      <th>shape</th><th>kind</th><th title="the model's line that made it, else the argument">
      attributed to</th>${COMPACT ? "" : "<th>op_name</th>"}
      <th class="num">live range</th></tr></thead><tbody>${rows.join("")}</tbody></table>`;
  }

  // ---- events ------------------------------------------------------------------------------
  wire() {
    const root = this.root;
    root.addEventListener("click", (e) => {
      const row = e.target.closest("tr[data-buffer], rect[data-buffer]");
      if (row && row.dataset.buffer) this.select(row.dataset.buffer, true);
    });
    root.addEventListener("keydown", (e) => {
      const row = e.target.closest("tr[data-buffer]");
      if (row && e.key === "Enter") this.select(row.dataset.buffer, true);
    });
    const legend = root.querySelector("[data-role=legend]");
    legend.addEventListener("mouseover", (e) => {
      const li = e.target.closest("li[data-band]");
      if (li) this.highlight(Number(li.dataset.band));
    });
    legend.addEventListener("mouseleave", () => this.highlight(null));
    this.zoomOut.addEventListener("click", () => { this.zoom = null; this.draw(); });
    const filter = root.querySelector("[data-role=filter]");
    const all = root.querySelector("[data-role=all]");
    const apply = () => {
      const q = filter.value.trim().toLowerCase();
      for (const tr of root.querySelectorAll("table.buffers tbody tr")) {
        const shown = (all.checked || tr.dataset.peak === "1") &&
          (!q || tr.dataset.text.includes(q));
        tr.hidden = !shown;
      }
    };
    filter.addEventListener("input", apply);
    all.addEventListener("change", apply);
    this.lanesEl.addEventListener("mousemove", (e) => {
      const bar = e.target.closest("rect[data-buffer]");
      if (!bar) { hideTip(); return; }
      showTip(this.bufferTip(this.byName.get(bar.dataset.buffer)), e);
    });
    this.lanesEl.addEventListener("mouseleave", hideTip);
  }

  highlight(band) {
    this.hotBand = band;
    for (const p of this.root.querySelectorAll("path.band")) {
      p.classList.toggle("dim", band !== null && Number(p.dataset.band) !== band);
    }
  }

  select(name, fromUser) {
    const b = this.byName.get(name);
    this.missing = b ? null : name;
    this.selected = b || null;
    for (const tr of this.root.querySelectorAll("tr.selected")) tr.classList.remove("selected");
    if (b) {
      for (const tr of this.root.querySelectorAll("table.buffers tr[data-buffer]")) {
        if (tr.dataset.buffer === name) {
          tr.classList.add("selected");
          tr.hidden = false;
        }
      }
    }
    this.drawDetail();
    this.draw();
    if (fromUser && b) {
      const hash = (COMPACT ? "report=" + encodeURIComponent(this.v.name) + "&" : "") +
        "buffer=" + encodeURIComponent(name);
      try { history.replaceState(null, "", "#" + hash); } catch (err) { /* file: URLs */ }
    }
  }

  // ---- drawing -----------------------------------------------------------------------------
  draw() {
    if (!this.t) return;
    this.drawChart();
    this.drawLanes();
    this.zoomOut.hidden = !this.zoom;
  }

  // The program points shown, [a, b): all of them unless zoomed in.
  range() { return this.zoom || [0, this.points]; }

  xScale(width) {
    const m = {l: 64, r: 16}, pw = width - m.l - m.r, [a, b] = this.range();
    const x = (p) => r1(m.l + (Math.min(Math.max(p, a), b) - a) * pw / (b - a));
    return {m, pw, a, b, x};
  }

  xAxis(s, y0) {
    const {x, a, b, pw} = s;
    const step = Math.max(1, Math.round(niceStep(b - a, Math.max(2, pw / 90))));
    let out = `<line class="axis" x1="${x(a)}" x2="${x(b)}" y1="${y0}" y2="${y0}"/>`;
    for (let p = Math.ceil(a / step) * step; p <= b; p += step) {
      out += `<line class="axis" x1="${x(p)}" x2="${x(p)}" y1="${y0}" y2="${y0 + 4}"/>
        <text x="${x(p)}" y="${y0 + 15}" text-anchor="middle">${p}</text>`;
    }
    return out;
  }

  stacked() {
    if (!this.cum) {
      let lo = new Array(this.points).fill(0);
      this.cum = this.t.layers.map((layer) => (lo = lo.map((v, p) => v + layer[p])));
    }
    return this.cum;
  }

  drawChart() {
    const t = this.t, cum = this.stacked();
    const W = Math.max(380, Math.floor(this.chartEl.clientWidth || 800));
    const H = COMPACT ? 250 : 300;
    const s = this.xScale(W), {m, pw, a, b, x} = s;
    const top = 26, ph = H - top - 40;
    const [scale, unit] = unitFor(this.yMax);
    const step = niceStep(this.yMax / scale, 4) * scale;
    const yTop = Math.max(step, Math.ceil(this.yMax * 1.06 / step) * step);
    const y = (v) => r1(top + ph - v / yTop * ph);
    let svg = "";
    for (let v = 0; v <= yTop + 1e-6; v += step) {
      svg += `<line class="grid" x1="${m.l}" x2="${m.l + pw}" y1="${y(v)}" y2="${y(v)}"/>
        <text x="${m.l - 8}" y="${y(v) + 4}" text-anchor="end">${+(v / scale).toFixed(2)}</text>`;
    }
    svg += `<text class="axis-title" transform="translate(14 ${top + ph / 2}) rotate(-90)"
      text-anchor="middle">live bytes (${unit})</text>`;
    let lo = new Array(this.points).fill(0);
    cum.forEach((hi, i) => {
      svg += `<path class="band" data-band="${i}" fill="${this.color(i)}" fill-opacity="0.88"
        d="${stepPath(hi, lo, a, b, x, y)}"/>`;
      lo = hi;
    });
    svg += `<path class="total" d="${stepLine(lo, a, b, x, y)}"/>`;
    const sel = this.selected;
    if (sel && sel.start !== null && sel.end >= a && sel.start < b) {
      const x0 = x(sel.start), x1 = Math.max(x(sel.end + 1), x0 + 2);
      svg += `<rect class="sel-span" x="${x0}" y="${top}" width="${r1(x1 - x0)}"
        height="${ph}"/><path class="sel-edge" d="M${x0},${top + ph}V${top}M${x1},${top}
        V${top + ph}M${x0},${top}H${x1}"/>`;
      const end = x0 > m.l + pw * 0.6;
      svg += `<text class="sel-label" x="${end ? x1 - 4 : x0 + 4}" y="${top + 12}"
        text-anchor="${end ? "end" : "start"}">${esc(sel.label)}</text>`;
    }
    if (t.peak_index >= a && t.peak_index < b) {
      const xp = r1(x(t.peak_index) + pw / (b - a) / 2), late = xp > m.l + 0.7 * pw;
      svg += `<line class="peak-line" x1="${xp}" x2="${xp}" y1="${y(t.peak_bytes) - 6}"
          y2="${top + ph}"/><circle class="peak-dot" cx="${xp}" cy="${y(t.peak_bytes)}" r="3"/>
        <text class="peak-label" x="${late ? xp - 6 : xp + 6}" y="${y(t.peak_bytes) - 8}"
          text-anchor="${late ? "end" : "start"}">peak ${fmtBytes(t.peak_bytes)}</text>`;
    }
    svg += this.xAxis(s, top + ph);
    svg += `<text class="axis-title" x="${m.l + pw / 2}" y="${H - 4}" text-anchor="middle">
      program point (XLA's schedule)${this.zoom ? `, points ${a}–${b - 1}` : ""}</text>`;
    svg += `<rect class="brush" data-role="brush" x="0" y="${top}" width="0" height="${ph}"
      visibility="hidden"/><line class="cursor" data-role="cursor" x1="0" x2="0" y1="${top}"
      y2="${top + ph}" visibility="hidden"/><rect class="hit" x="${m.l}" y="${top}"
      width="${pw}" height="${ph}" fill="transparent"/>`;
    this.chartEl.innerHTML = `<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}"
      role="img" aria-label="live bytes over the program of ${esc(this.v.name)}">${svg}</svg>`;
    this.highlight(this.hotBand);
    this.wireChart(this.chartEl.firstElementChild, {W, H, m, pw, a, b, x, top, ph, yTop});
  }

  wireChart(svgEl, g) {
    const cum = this.stacked();
    const cursor = svgEl.querySelector("[data-role=cursor]");
    const brush = svgEl.querySelector("[data-role=brush]");
    const local = (e) => {
      const rect = svgEl.getBoundingClientRect();
      return [(e.clientX - rect.left) * g.W / rect.width,
        (e.clientY - rect.top) * g.H / rect.height];
    };
    const pointAt = (px) => Math.min(g.b - 1, Math.max(g.a,
      g.a + Math.floor((px - g.m.l) / g.pw * (g.b - g.a))));
    const at = (e) => {
      const [px, py] = local(e), p = pointAt(px), value = (g.top + g.ph - py) / g.ph * g.yTop;
      let band = null;
      for (let i = 0; i < cum.length; i++) {
        if (value <= cum[i][p] && cum[i][p] > (i ? cum[i - 1][p] : 0)) { band = i; break; }
      }
      return {p, band, px};
    };
    let drag = null;
    svgEl.addEventListener("mousedown", (e) => { drag = {from: local(e)[0], moved: false}; });
    svgEl.addEventListener("mousemove", (e) => {
      const {p, band, px} = at(e);
      if (drag && Math.abs(px - drag.from) > 4) {
        drag.moved = true;
        const lo = Math.max(g.m.l, Math.min(px, drag.from));
        const hi = Math.min(g.m.l + g.pw, Math.max(px, drag.from));
        brush.setAttribute("x", r1(lo));
        brush.setAttribute("width", r1(hi - lo));
        brush.setAttribute("visibility", "visible");
        hideTip();
        return;
      }
      const xc = r1(g.x(p) + g.pw / (g.b - g.a) / 2);
      cursor.setAttribute("x1", xc);
      cursor.setAttribute("x2", xc);
      cursor.setAttribute("visibility", "visible");
      showTip(this.pointTip(p, band), e);
    });
    svgEl.addEventListener("mouseleave", () => {
      drag = null;
      brush.setAttribute("visibility", "hidden");
      cursor.setAttribute("visibility", "hidden");
      hideTip();
    });
    svgEl.addEventListener("mouseup", (e) => {
      const {p, band, px} = at(e);
      if (drag && drag.moved) {
        const p0 = pointAt(Math.min(px, drag.from)), p1 = pointAt(Math.max(px, drag.from));
        drag = null;
        hideTip();
        if (p1 > p0) { this.zoom = [p0, p1 + 1]; this.draw(); }
        return;
      }
      drag = null;
      const live = this.holders(p).filter((h) => band === null || h.band === band);
      if (live.length) this.select(live[0].name, true);
    });
    svgEl.addEventListener("dblclick", () => { this.zoom = null; this.draw(); });
  }

  pointTip(p, band) {
    const t = this.t, live = this.holders(p);
    const rows = t.bands.map((b, i) => [i, t.layers[i][p]]).filter(([, v]) => v > 0).reverse()
      .map(([i, v]) => `<tr class="${i === band ? "hot" : ""}"><td><span class="swatch"
        style="background:${this.color(i)}"></span></td><td>${esc(t.bands[i].label)}</td>
        <td class="num">${fmtBytes(v)}</td></tr>`).join("");
    const largest = live.filter((h) => band === null || h.band === band).slice(0, 4)
      .map((h) => `<div>${esc(h.label)} <code>${esc(fmtShape(h))}</code>
        ${fmtBytes(h.bytes)}</div>`).join("");
    return `<div class="tt-head">point ${p}: <code>${esc(this.instr(p))}</code></div>
      <div>live ${fmtBytes(t.timeline[p])}${p === t.peak_index ? " (the peak)" : ""},
        ${live.length} buffers</div>
      <table>${rows}</table>
      ${largest ? `<div class="tt-foot">largest ${band === null ? "" : "in " +
        esc(t.bands[band].label)} here:</div>${largest}` : ""}
      <div class="tt-foot">click to inspect the largest</div>`;
  }

  bufferTip(b) {
    return `<div class="tt-head">${esc(b.label)} · ${fmtBytes(b.bytes)}</div>
      <div><code>${esc(fmtShape(b))}</code> · ${esc(b.kind)}${b.loop_state ? " (loop)" : ""}
        ${b.backward ? " · backward" : ""}</div>
      <div class="tt-foot">live ${b.start}–${b.end} · XLA's <code>${esc(b.name)}</code> ·
        click for details</div>`;
  }

  drawLanes() {
    const t = this.t;
    const rows = t.peak_buffers.slice(0, LANES).map((n) => this.byName.get(n));
    const W = Math.max(380, Math.floor(this.lanesEl.clientWidth || 800));
    // Each bar has its label on a line of its own above it, starting where the bar starts
    // (moved left where the text would run past the right edge).
    const rowH = 28, top = 4, H = top + rows.length * rowH + 24;
    const s = this.xScale(W), {m, pw, a, b, x} = s;
    let svg = "";
    rows.forEach((buf, i) => {
      const yy = top + i * rowH, label = `${buf.label} · ${fmtBytes(buf.bytes)}`;
      const room = label.length * 6.4 + 6;
      if (buf.end < a || buf.start >= b) {
        svg += `<text class="lane-label" x="${m.l}" y="${yy + 19}" opacity="0.5">${
          esc(label)} (outside the zoom)</text>`;
        return;
      }
      const x0 = x(buf.start), x1 = Math.max(x(buf.end + 1), x0 + 2), w = r1(x1 - x0);
      const sel = this.selected && this.selected.name === buf.name ? " selected" : "";
      svg += `<rect class="lane${sel}" data-buffer="${esc(buf.name)}" x="${x0}" y="${yy + 14}"
        width="${w}" height="11" rx="3" fill="${this.color(buf.band)}"><title>${
        esc(buf.label)} (XLA's ${esc(buf.name)})</title></rect>`;
      const lx = Math.max(4, Math.min(x0, W - 4 - room));
      svg += `<text class="lane-label" x="${r1(lx)}" y="${yy + 11}">${esc(label)}</text>`;
    });
    if (t.peak_index >= a && t.peak_index < b) {
      const xp = r1(x(t.peak_index) + pw / (b - a) / 2);
      svg += `<line class="peak-line" x1="${xp}" x2="${xp}" y1="${top}"
        y2="${top + rows.length * rowH}"/>`;
    }
    svg += this.xAxis(s, top + rows.length * rowH);
    this.lanesEl.innerHTML = `<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}"
      role="img" aria-label="live ranges of the largest buffers at the peak">${svg}</svg>`;
  }

  drawDetail() {
    const d = this.detailEl;
    if (!d) return;
    const b = this.selected;
    d.removeAttribute("data-buffer");
    if (!b) {
      d.innerHTML = `<h3>Buffer details</h3>
        ${this.missing === null ? "" : `<p class="missing">No buffer named
          <code>${esc(this.missing)}</code> in this report.</p>`}
        <p class="muted">Hover the chart to see what is live at a point of the program; click
        a band, a bar or a table row to inspect a buffer here. Opening this page with
        <code>#buffer=NAME</code> in the address shows buffer NAME.</p>`;
      return;
    }
    const t = this.t, P = this.points;
    d.dataset.buffer = b.name;
    const band = b.band === null ? "" : `<span class="swatch" style="background:${
      this.color(b.band)}"></span> ${esc(t.bands[b.band].label)}`;
    const atPeak = this.peakSet.has(b.name);
    const range = b.start === null ? "not in XLA's live ranges" : `points ${b.start}–${b.end}
      (${b.end - b.start + 1} of ${P})<div class="muted">from <code>${esc(this.instr(b.start))}
      </code> to <code>${esc(this.instr(b.end))}</code></div>`;
    const origin = b.origin && b.origin !== b.instruction
      ? ` <span class="muted">(data from <code>${esc(b.origin)}</code>)</span>` : "";
    const bar = b.start === null ? "" : `<div class="range" title="live range over the program">
      <span style="left:${(100 * b.start / P).toFixed(2)}%;width:${Math.max(0.6,
        100 * (b.end - b.start + 1) / P).toFixed(2)}%;background:${this.color(b.band)}"></span>
      <i style="left:${(100 * (t.peak_index + 0.5) / P).toFixed(2)}%"></i></div>
      <div class="muted" style="font-size:11px">live range; the red tick is the peak</div>`;
    const chain = b.chain.length ? `<ol class="chain">${b.chain.map((c, i) =>
      `<li title="${esc(b.chain_paths[i])}">${esc(c)}</li>`).join("")}</ol>` : "—";
    d.innerHTML = `<h3><span data-role="label">${esc(b.label)}</span>
        <span class="badge ${esc(b.kind)}">${esc(b.kind)}</span>
        ${b.backward ? '<span class="badge backward">backward</span>' : ""}</h3>
      <div class="detail-size">${fmtBytes(b.bytes)}
        <span class="muted">${fmtInt(b.bytes)} bytes</span></div>
      <dl>
        <dt>XLA's name</dt><dd data-field="name"><code>${esc(b.name)}</code></dd>
        <dt>shape</dt><dd data-field="shape"><code>${esc(fmtShape(b))}</code></dd>
        <dt>dtype</dt><dd data-field="dtype"><code>${esc(b.dtype)}</code></dd>
        <dt>kind</dt><dd data-field="kind">${esc(b.kind)}${b.loop_state
          ? " · loop state (a while loop's carried value)" : ""}</dd>
        <dt>pass</dt><dd data-field="pass">${b.backward ? "backward (transpose)" : "forward"}
          </dd>
        <dt>source</dt><dd data-field="source">${b.source ? `${esc(b.short_source)}
          <div class="muted path">${esc(b.source)}</div>` : "—"}</dd>
        <dt>call chain</dt><dd data-field="chain">${chain}</dd>
        ${b.argument ? `<dt>argument</dt><dd data-field="argument"><code>${
          esc(b.argument)}</code></dd>` : ""}
        <dt>op_name</dt><dd data-field="op_name"><code>${esc(b.op_name || "—")}</code></dd>
        <dt>instruction</dt><dd data-field="instruction"><code>${esc(b.instruction)}</code>
          ${origin}</dd>
        <dt>live range</dt><dd data-field="live_range">${range}</dd>
        <dt>at the peak</dt><dd data-field="at_peak">${atPeak ? "live, in " + band
          : "not live"}</dd>
        <dt>memory</dt><dd data-field="memory">allocation ${b.allocation}, offset
          ${fmtInt(b.offset)}${b.memory_space ? `, memory space ${b.memory_space} (host)` : ""}
          </dd>
      </dl>${bar}`;
  }
}

function stepPath(hi, lo, a, b, x, y) {
  let d = `M${x(a)},${y(hi[a])}`;
  for (let p = a + 1; p < b; p++) if (hi[p] !== hi[p - 1]) d += `H${x(p)}V${y(hi[p])}`;
  d += `H${x(b)}V${y(lo[b - 1])}`;
  for (let p = b - 1; p > a; p--) if (lo[p - 1] !== lo[p]) d += `H${x(p)}V${y(lo[p - 1])}`;
  return d + `H${x(a)}Z`;
}
function stepLine(hi, a, b, x, y) {
  let d = `M${x(a)},${y(hi[a])}`;
  for (let p = a + 1; p < b; p++) if (hi[p] !== hi[p - 1]) d += `H${x(p)}V${y(hi[p])}`;
  return d + `H${x(b)}`;
}

function comparisonHeader(reports) {
  const cols = DATA.columns;
  const rows = DATA.rows.map((row, i) => {
    const cells = row.values.map((v, j) => {
      const r = row.ratios[j];
      const cls = r === null || i === 0 ? "" : r < 0.995 ? "better" : r > 1.005 ? "worse" : "";
      const ratio = v === null ? "" : `<span class="ratio ${cls}">×${r === null ? "n/a"
        : r.toFixed(2)}</span>`;
      return `<td class="num">${fmtBytes(v)}${ratio}</td>`;
    }).join("");
    return `<tr><td><button class="linkish" data-goto="${i}">${esc(row.label)}</button>
      ${row.label === DATA.baseline ? '<span class="badge">baseline</span>' : ""}</td>
      ${cells}</tr>`;
  }).join("");
  const box = el(`<header class="page-head">
    <div class="eyebrow">jaxmem memory comparison</div>
    <h1>${reports.map((r) => `<code>${esc(r.v.name)}</code>`).join(" vs ")}</h1>
    <p class="meta">The same arguments compiled ${reports.length} ways; ratios against
      <b>${esc(DATA.baseline)}</b>. The timelines below share one scale of bytes; each one's
      x axis is its own program.</p>
    <div class="box" style="margin-top:12px"><div class="table-scroll">
      <table class="data compare"><thead><tr><th>label</th>${cols.map(
        (c) => `<th class="num">${esc(c)}</th>`).join("")}</tr></thead>
      <tbody>${rows}</tbody></table></div></div></header>`);
  box.addEventListener("click", (e) => {
    const b = e.target.closest("[data-goto]");
    if (b) reports[Number(b.dataset.goto)].root.scrollIntoView({behavior: "smooth"});
  });
  return box;
}

// A PeakDiff (diff.py, to_dict): rows of the two peaks by source, in three groups.
const DIFF_GROUPS = [
  ["freed", ["freed"], (a, b) => `freed: at ${a}'s peak only`],
  ["added", ["added"], (a, b) => `added: at ${b}'s peak only`],
  ["common", ["grown", "shrunk", "same"], () => "common to both peaks"],
];
function fmtChange(n) { return (n > 0 ? "+" : n < 0 ? "−" : "") + fmtBytes(Math.abs(n)); }
function exact(n) {
  return `${fmtBytes(n)}<div class="muted exact">${fmtInt(n)} B</div>`;
}

function diffPanel(diff, index, reports) {
  const peakOf = (label) => {
    const r = reports.find((x) => x.v.name === label);
    return r && r.t ? r.t.peak_bytes : null;
  };
  const row = (cls, attrs, head, a, b) => `<tr class="${cls}" ${attrs} data-a-bytes="${a}"
    data-b-bytes="${b}"><td>${head}</td><td class="num">${exact(a)}</td>
    <td class="num">${exact(b)}</td><td class="num">${fmtChange(b - a)}</td><td></td></tr>`;
  let sumA = 0, sumB = 0, body = "";
  for (const [group, statuses, title] of DIFF_GROUPS) {
    const rows = diff.rows.filter((r) => statuses.includes(r.status));
    if (!rows.length) continue;
    let ga = 0, gb = 0;
    const trs = rows.map((r) => {
      ga += r.a_bytes;
      gb += r.b_bytes;
      return `<tr data-status="${esc(r.status)}" data-a-bytes="${r.a_bytes}"
          data-b-bytes="${r.b_bytes}">
        <td class="src" title="${esc(r.key || r.source)}">${esc(r.source)}</td>
        <td class="num">${r.a_bytes ? fmtBytes(r.a_bytes) : "—"}</td>
        <td class="num">${r.b_bytes ? fmtBytes(r.b_bytes) : "—"}</td>
        <td class="num change ${r.b_bytes < r.a_bytes ? "better" : r.b_bytes > r.a_bytes
          ? "worse" : ""}">${fmtChange(r.b_bytes - r.a_bytes)}</td>
        <td><span class="badge status-${esc(r.status)}">${esc(r.status)}</span></td></tr>`;
    }).join("");
    sumA += ga;
    sumB += gb;
    body += `<tbody data-group="${group}"><tr class="group"><th colspan="5">${
      esc(title(diff.a, diff.b))} · ${rows.length} source${rows.length === 1 ? "" : "s"}</th>
      </tr>${trs}${row("subtotal", 'data-role="subtotal"', "subtotal", ga, gb)}</tbody>`;
  }
  const pa = peakOf(diff.a), pb = peakOf(diff.b);
  const ok = sumA === pa && sumB === pb;
  const box = el(`<section class="box diff" data-diff="${index}" data-a="${esc(diff.a)}"
      data-b="${esc(diff.b)}">
    <div class="box-head"><h3>What each peak holds, by source: <code>${esc(diff.a)}</code> →
      <code>${esc(diff.b)}</code></h3><span class="hint">the buffers live at each report's
      peak, grouped by the model's line that made them (else the argument's pytree path); each
      column adds up to its report's peak</span></div>
    <div class="table-scroll"><table class="data diff"><thead><tr><th>source</th>
      <th class="num">${esc(diff.a)}</th><th class="num">${esc(diff.b)}</th>
      <th class="num">change</th><th>status</th></tr></thead>${body}
      <tfoot>${row("sum", 'data-role="sum"', "sum of the rows", sumA, sumB)}
      ${row(ok ? "peak" : "peak worse", 'data-role="peak"', "peak of each report (live bytes)",
        pa, pb)}</tfoot></table></div>
    ${ok ? "" : '<p class="missing">The rows do not add up to the peaks.</p>'}</section>`);
  return box;
}

function applyHash(reports) {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  const name = params.get("buffer");
  if (name === null) return;
  const label = params.get("report");
  const pool = reports.filter((r) => r.t && (label === null || r.v.name === label));
  const hit = pool.find((r) => r.byName.has(name));
  if (hit) hit.select(name, false);
  else if (pool.length) pool[0].select(name, false);
}

function main() {
  const app = document.getElementById("app");
  const reports = DATA.reports.map((view, i) => new Report(view, i));
  for (const r of reports) if (r.t) for (const b of r.t.bands) colorOf(b.label);
  const peaks = reports.filter((r) => r.t).map((r) => r.t.peak_bytes);
  const yMax = Math.max(1, ...peaks);
  if (COMPACT) {
    app.appendChild(comparisonHeader(reports));
    (DATA.diffs || []).forEach((d, i) => app.appendChild(diffPanel(d, i, reports)));
    const grid = el(`<div class="compare-grid" style="grid-template-columns:repeat(${
      reports.length}, minmax(${reports.length > 2 ? 420 : 560}px, 1fr))"></div>`);
    app.appendChild(grid);
    for (const r of reports) grid.appendChild(r.render(yMax));
  } else {
    for (const r of reports) app.appendChild(r.render(r.t ? r.t.peak_bytes : 1));
  }
  for (const r of reports) { r.draw(); r.drawDetail(); }
  applyHash(reports);
  window.addEventListener("hashchange", () => applyHash(reports));
  let pending = null;
  window.addEventListener("resize", () => {
    clearTimeout(pending);
    pending = setTimeout(() => { for (const r of reports) r.draw(); }, 120);
  });
  document.documentElement.dataset.viewer = "ready";
}

main();
})();
