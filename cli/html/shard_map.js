// The shard map page: one tensor's global shape drawn with every stored box, coloured by the rank
// holding it (replicas outlined and counted, gaps hatched, overlaps framed in red), a search over
// tensor names, and the bytes each rank stores. A plan's page draws the source's and the target's
// maps side by side, and what each target rank writes, reads and opens. Everything comes from the
// JSON in #data (common.js); nothing is fetched.

// The two dims drawn: those split into the most pieces (rows, then columns), in tensor order.
function shownDims(shape, offsets, n) {
  const ndim = shape.length;
  if (ndim <= 1) return ndim === 1 ? [null, 0] : [null, null];
  const pieces = shape.map((_, d) => {
    const seen = new Set();
    for (let i = 0; i < n; i++) seen.add(offsets[i * ndim + d]);
    return seen.size;
  });
  const order = shape.map((_, d) => d).sort((a, b) => pieces[b] - pieces[a] || a - b);
  return order.slice(0, 2).sort((a, b) => a - b);
}

function drawTensor(map, index, target) {
  const data = map, cols = map.cols;
  const [name, dtype, shape, layout, nbytes, first, n] = data.tensors[index];
  const ndim = shape.length;
  target.replaceChildren();
  target.appendChild(el("h2", {}, map.label ? `${map.label}: ${name}` : name));
  const facts = el("div", { class: "facts" });
  for (const t of [dtype, "[" + shape.join(", ") + "]", layout, human(nbytes), `${n} chunks`]) facts.appendChild(el("span", {}, t));
  target.appendChild(facts);
  const offsets = cols.offsets.subarray(first * ndim, (first + n) * ndim);
  const sizes = cols.sizes.subarray(first * ndim, (first + n) * ndim);
  const ranks = cols.ranks.subarray(first, first + n);
  // one drawn box per distinct stored box; its ranks are the replicas
  const boxes = new Map();
  for (let i = 0; i < n; i++) {
    const o = Array.from(offsets.subarray(i * ndim, (i + 1) * ndim));
    const s = Array.from(sizes.subarray(i * ndim, (i + 1) * ndim));
    const key = o.join(",") + "|" + s.join(",");
    if (!boxes.has(key)) boxes.set(key, { o, s, ranks: [] });
    boxes.get(key).ranks.push(ranks[i]);
  }
  const [rowDim, colDim] = shownDims(shape, offsets, n);
  const rows = rowDim === null ? 1 : shape[rowDim];
  const columns = colDim === null ? 1 : shape[colDim];
  const width = Math.max(300, Math.min(900, (target.clientWidth || 900) - 12));
  const height = Math.max(48, Math.min(560, rowDim === null ? 48 : (width * rows) / Math.max(columns, 1)));
  const sx = width / Math.max(columns, 1), sy = height / Math.max(rows, 1);
  const svg = el("svg", { width: width + 2, height: height + 2, class: "map", "data-tensor": name }, null, SVG);
  const defs = el("defs", {}, null, SVG);
  const hatch = el("pattern", { id: "hatch", width: 6, height: 6, patternUnits: "userSpaceOnUse",
                                patternTransform: "rotate(45)" }, null, SVG);
  hatch.appendChild(el("rect", { width: 3, height: 6, fill: "#f3b0b0" }, null, SVG));
  defs.appendChild(hatch);
  svg.appendChild(defs);
  svg.appendChild(el("rect", { x: 1, y: 1, width, height, fill: "#fff", stroke: "#8a94a3" }, null, SVG));
  const at = (o, s) => {
    const y = rowDim === null ? 0 : o[rowDim], h = rowDim === null ? 1 : s[rowDim];
    const x = colDim === null ? 0 : o[colDim], w = colDim === null ? 1 : s[colDim];
    return { x: 1 + x * sx, y: 1 + y * sy, width: Math.max(w * sx, 0.5), height: Math.max(h * sy, 0.5) };
  };
  const present = new Set();
  let replicated = 0, empty = 0;
  for (const box of boxes.values()) {
    if (box.s.some((v) => v === 0) && !shape.some((v) => v === 0)) { empty += box.ranks.length; continue; }
    box.ranks.forEach((r) => present.add(r));
    const g = at(box.o, box.s);
    const many = box.ranks.length > 1;
    if (many) replicated += 1;
    const rect = el("rect", { ...g, class: "box" + (many ? " replicated" : ""), fill: colour(box.ranks[0]),
                              "data-ranks": box.ranks.join(","), "data-region": region(box.o, box.s) }, null, SVG);
    const bytes = box.s.reduce((a, b) => a * b, 1) * (nbytes / Math.max(shape.reduce((a, b) => a * b, 1), 1));
    svg.appendChild(tipped(rect, `${region(box.o, box.s)}\nrank${many ? "s" : ""} ${box.ranks.join(", ")}\n${human(Math.round(bytes))}`));
    if (many && g.width > 24 && g.height > 14) {
      svg.appendChild(el("text", { x: g.x + 4, y: g.y + 13, class: "replicas" }, `×${box.ranks.length}`, SVG));
    }
  }
  const problems = data.problems[name] || {};
  for (const [kind, cls] of [["gaps", "gap"], ["overlaps", "overlap"]]) {
    for (const text of problems[kind] || []) {
      const [o, s] = parseRegion(text);
      svg.appendChild(tipped(el("rect", { ...at(o, s), class: cls, "data-region": text }, null, SVG),
                             `${kind === "gaps" ? "no chunk covers" : "chunks overlap at"} ${text}`));
    }
  }
  target.appendChild(svg);
  const shown = rowDim === null ? (colDim === null ? "a 0-d tensor" : `dim ${colDim} across`)
    : `dim ${rowDim} down, dim ${colDim} across`;
  const other = shape.map((_, d) => d).filter((d) => d !== rowDim && d !== colDim && boxes.size > 1 &&
    new Set(Array.from({ length: n }, (_, i) => offsets[i * ndim + d])).size > 1);
  target.appendChild(el("div", { class: "note" }, `Drawn: ${shown}` +
    (other.length ? `; also split along dim ${other.join(", ")} (those boxes are drawn over each other)` : "") +
    (replicated ? `; ${replicated} box(es) held by several ranks (dashed, ×count)` : "") +
    (empty ? `; ${empty} empty box(es) not drawn` : "")));
  const bad = [...(problems.gaps || []).map((g) => "gap " + g), ...(problems.overlaps || []).map((g) => "overlap " + g),
               ...(problems.notes || [])];
  if (bad.length) target.appendChild(el("div", { class: "problems" }, bad.join("; ")));
  const legend = el("div", { class: "legend" });
  const sorted = [...present].sort((a, b) => a - b);
  for (const r of sorted.slice(0, 48)) {
    const item = el("span", { "data-rank": r });
    item.appendChild(el("i", { style: `background:${colour(r)}` }));
    item.appendChild(document.createTextNode(r < 0 ? "no rank" : `rank ${r}`));
    legend.appendChild(item);
  }
  if (sorted.length > 48) legend.appendChild(el("span", {}, `and ${sorted.length - 48} more ranks`));
  target.appendChild(legend);
}

function drawRanks(data, target, title = "Bytes stored per rank") {
  const bytes = data.rank_bytes;
  target.appendChild(el("h2", {}, `${title} (${bytes.length} ranks)`));
  if (!bytes.length) { target.appendChild(el("div", { class: "note" }, "no file names a rank")); return; }
  const most = Math.max(...bytes, 1), bar = Math.max(2, Math.min(24, Math.floor(900 / bytes.length)));
  const height = 120, svg = el("svg", { width: bytes.length * bar + 2, height: height + 16, class: "ranks" }, null, SVG);
  bytes.forEach((b, r) => {
    const h = Math.max((b / most) * height, b ? 1 : 0);
    svg.appendChild(tipped(el("rect", { x: 1 + r * bar, y: height - h, width: Math.max(bar - 1, 1), height: h,
                                        fill: colour(r), class: "rank-bar", "data-rank": r, "data-bytes": b }, null, SVG),
                           `rank ${r}: ${human(b)}`));
  });
  target.appendChild(svg);
}

function drawPlan(data, target) {
  const rows = data.plan.ranks;  // [rank, written, read, files]
  const written = rows.reduce((a, r) => a + r[1], 0), read = rows.reduce((a, r) => a + r[2], 0);
  target.appendChild(el("h2", {}, `Target ranks: what each writes and reads (${rows.length} ranks)`));
  const facts = el("div", { class: "facts", id: "plan-totals" });
  const predicted = data.plan.prediction;
  const seconds = new Map((predicted ? predicted.ranks : []).map((p) => [p.rank, p.seconds]));
  for (const t of [`writes ${human(written)}`, `reads ${human(read)}`,
                   `read amplification ${written ? (read / written).toFixed(2) : "-"}`,
                   predicted ? `predicted ${predicted.seconds.toFixed(2)} s (reads at ${human(predicted.read_bytes_per_s)}/s, `
                     + `writes at ${human(predicted.write_bytes_per_s)}/s)` : "no predicted time (no bandwidth measured)"]) {
    facts.appendChild(el("span", {}, t));
  }
  target.appendChild(facts);
  const most = Math.max(1, ...rows.map((r) => Math.max(r[1], r[2])));
  const bar = Math.max(2, Math.min(24, Math.floor(900 / Math.max(rows.length, 1))));
  const height = 120, svg = el("svg", { width: rows.length * bar + 2, height: height + 4, class: "plan" }, null, SVG);
  const files = el("div", { id: "files", class: "note" }, "click a rank's bar for the source files it opens");
  rows.forEach(([rank, w, r, n], i) => {
    const half = Math.max(Math.floor((bar - 1) / 2), 1);
    for (const [value, x, fill, kind] of [[w, 0, "#2f6fc0", "written"], [r, half, "#e08a2c", "read"]]) {
      const h = Math.max((value / most) * height, value ? 1 : 0);
      const rect = el("rect", { x: 1 + i * bar + x, y: height - h, width: half, height: h, fill, class: `plan-bar ${kind}`,
                                "data-rank": rank, "data-written": w, "data-read": r, "data-files": n,
                                "data-predicted-s": seconds.has(rank) ? seconds.get(rank) : "" }, null, SVG);
      tipped(rect, `rank ${rank}: writes ${human(w)}, reads ${human(r)} from ${n} file(s)` +
                   (seconds.has(rank) ? `; predicted ${seconds.get(rank).toFixed(3)} s` : ""));
      rect.addEventListener("click", () => {
        const from = data.plan.touchedStart[i], to = data.plan.touchedStart[i + 1];
        files.replaceChildren(el("div", {}, `rank ${rank} opens ${to - from} source file(s):`));
        const list = el("ol", { class: "touched", "data-rank": rank });
        for (let k = from; k < to; k++) list.appendChild(el("li", {}, data.plan.files[data.plan.touched[k]]));
        files.appendChild(list);
      });
      svg.appendChild(rect);
    }
  });
  target.append(svg, files);
}

async function main() {
  const started = performance.now();
  const data = JSON.parse(document.getElementById("data").textContent);
  const maps = data.maps;
  for (const m of maps) {
    m.cols = {
      offsets: await inflate(m.columns.offsets, Float64Array),
      sizes: await inflate(m.columns.sizes, Float64Array),
      ranks: await inflate(m.columns.ranks, Int32Array),
    };
    m.byName = new Map(m.tensors.map((t, i) => [t[0], i]));
  }
  if (data.plan) {
    data.plan.touched = await inflate(data.plan.touched, Int32Array);
    data.plan.touchedStart = await inflate(data.plan.touched_start, Int32Array);
  }
  const tensors = maps[0].tensors;
  const row = el("div", { class: maps.length > 1 ? "side-by-side" : "" });
  const panes = maps.map((m) => { const pane = el("div", { class: "pane", "data-map": m.label || "checkpoint" }); row.appendChild(pane); return pane; });
  const extra = el("div", { id: "ranks" });
  frame(data, tensors.map((t) => t[0]), (name) => maps.some((m) => m.problems[name]) ? "gaps/overlaps" : "",
        (i) => maps.forEach((m, k) => {
          const at = m.byName.get(tensors[i][0]);
          if (at === undefined) panes[k].replaceChildren(el("div", { class: "note" }, `${m.label}: not written`));
          else drawTensor(m, at, panes[k]);
        }), [row, extra]);
  if (data.plan) drawPlan(data, extra);
  else drawRanks(maps[0], extra);
  ready(started);
}

run(main);
