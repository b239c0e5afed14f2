"""The dashboard's page: HTML, CSS and the script that draws it as SVG, all served by the server
(no CDN, no external network). Kept as a Python string so it ships inside the package.

The script reads the API key from the URL fragment (``/dashboard#key=KEY``: a fragment is never
sent to a server nor logged), polls ``/dashboard/data`` with it, and draws the inference and
fine-tuning throughput as a stacked band over time with the SLO attainment line on the right
axis. The chart's ``data-points`` attribute counts the points drawn."""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>DeltaServe: co-serving dashboard</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; }
  h1 { font-size: 18px; margin: 0 0 4px; }
  #status { color: #555; margin-bottom: 12px; min-height: 1.2em; }
  svg { border: 1px solid #ddd; background: #fff; }
  .axis { stroke: #888; stroke-width: 1; }
  .grid { stroke: #eee; stroke-width: 1; }
  .label { fill: #555; font-size: 11px; }
  .inference { fill: #4c78a8; fill-opacity: 0.75; stroke: none; }
  .finetune { fill: #f58518; fill-opacity: 0.75; stroke: none; }
  .slo { fill: none; stroke: #2ca02c; stroke-width: 2; }
  .slo-target { stroke: #2ca02c; stroke-dasharray: 4 4; stroke-width: 1; }
  .legend span { display: inline-block; margin-right: 16px; }
  .swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
            vertical-align: -2px; }
</style>
</head>
<body>
<h1>DeltaServe co-serving</h1>
<div id="status">waiting for data…</div>
<div class="legend">
  <span><i class="swatch" style="background:#4c78a8"></i>inference tokens/s</span>
  <span><i class="swatch" style="background:#f58518"></i>fine-tuning tokens/s</span>
  <span><i class="swatch" style="background:#2ca02c"></i>SLO attainment (right axis)</span>
</div>
<svg id="chart" width="960" height="380" viewBox="0 0 960 380" data-points="0"></svg>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
const W = 960, H = 380, L = 64, R = 64, T = 28, B = 36;
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const svg = document.getElementById("chart");
const statusLine = document.getElementById("status");

function el(name, attrs, text) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  svg.appendChild(e);
  return e;
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function draw(data) {
  const pts = data.points;
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  svg.setAttribute("data-points", String(pts.length));
  const t0 = pts.length ? pts[0].t_s : 0, t1 = pts.length ? pts[pts.length - 1].t_s : 1;
  const span = Math.max(t1 - t0, 1e-9);
  const top = niceMax(Math.max(1, ...pts.map(p => p.inference_tokens_per_s + p.ft_tokens_per_s)));
  const x = t => L + (W - L - R) * (pts.length > 1 ? (t - t0) / span : 0.5);
  const y = v => H - B - (H - T - B) * v / top;
  const ySlo = a => H - B - (H - T - B) * a;
  for (let i = 0; i <= 4; i++) {
    const v = top * i / 4;
    el("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid"});
    el("text", {x: L - 6, y: y(v) + 4, "text-anchor": "end", class: "label"}, v.toFixed(0));
    el("text", {x: W - R + 6, y: ySlo(i / 4) + 4, class: "label"}, (25 * i) + "%");
  }
  el("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"});
  el("line", {x1: W - R, x2: W - R, y1: T, y2: H - B, class: "axis"});
  el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"});
  el("text", {x: L, y: H - 8, class: "label"}, (t0).toFixed(0) + " s");
  el("text", {x: W - R, y: H - 8, "text-anchor": "end", class: "label"}, (t1).toFixed(0) + " s");
  el("text", {x: L, y: 14, "text-anchor": "middle", class: "label"}, "tokens/s");
  el("text", {x: W - R, y: 14, "text-anchor": "middle", class: "label"}, "SLO");
  el("line", {x1: L, x2: W - R, y1: ySlo(1), y2: ySlo(1), class: "slo-target"});
  if (!pts.length) return;
  const band = (lo, hi) => {
    const up = pts.map(p => x(p.t_s) + "," + y(hi(p)));
    const down = pts.slice().reverse().map(p => x(p.t_s) + "," + y(lo(p)));
    return up.concat(down).join(" ");
  };
  el("polygon", {class: "inference", points: band(p => 0, p => p.inference_tokens_per_s)});
  const total = p => p.inference_tokens_per_s + p.ft_tokens_per_s;
  el("polygon", {class: "finetune", points: band(p => p.inference_tokens_per_s, total)});
  const slo = pts.filter(p => p.slo_attainment !== null);
  if (slo.length) {
    const line = slo.map(p => x(p.t_s) + "," + ySlo(p.slo_attainment));
    el("polyline", {class: "slo", points: line.join(" ")});
  }
  for (const p of pts) {
    el("circle", {cx: x(p.t_s), cy: y(total(p)), r: 1.5, class: "point", fill: "#333"});
  }
  const last = pts[pts.length - 1];
  statusLine.textContent = "inference " + last.inference_tokens_per_s.toFixed(1) +
    " tok/s · fine-tuning " + last.ft_tokens_per_s.toFixed(1) + " tok/s · " +
    data.jobs_running + " job(s) running, " + data.jobs_queued + " queued";
}

async function refresh() {
  try {
    const headers = key ? {Authorization: "Bearer " + key} : {};
    const r = await fetch("/dashboard/data", {headers});
    if (r.status === 401) {
      statusLine.textContent = "add #key=YOUR_API_KEY to this page's address";
      return;
    }
    draw(await r.json());
  } catch (e) {
    statusLine.textContent = "server unreachable: " + e;
  }
}
refresh();
setInterval(refresh, __INTERVAL_MS__);
</script>
</body>
</html>
"""


def render(interval_s: float) -> str:
    return PAGE.replace("__INTERVAL_MS__", str(max(250, int(interval_s * 1000))))
