// The diff page: per tensor, where the two checkpoints differ. The tensor is cut into at most
// 32 x 32 blocks (dim 0 down, the other dims flattened across); each block is coloured by its
// largest relative error (grey: equal; yellow: within the tolerances; red, darker for larger
// errors: outside them), with its numbers on hover. Entries on one side only are listed too.

function num(x) {  // a figure to read: 4 significant digits (JSON holds "inf" and "nan" as text)
  return typeof x === "number" && x !== 0 ? String(Number(x.toPrecision(4))) : String(x);
}

function blockColour(maxRel, differing) {
  if (maxRel === 0 || maxRel === "0") return "#e6e9ee";
  if (!differing) return "#f4e3a1";
  const r = maxRel === "inf" || maxRel === "nan" ? 1 : Math.min(1, Math.max(0, (Math.log10(maxRel) + 8) / 8));
  return `hsl(0, 70%, ${78 - 48 * r}%)`;
}

function drawDiff(data, row, target) {
  const [name, status, dtypeA, dtypeB, shape, differing, maxAbs, maxRel, grid] = row;
  target.replaceChildren();
  target.appendChild(el("h2", {}, name));
  const facts = el("div", { class: "facts" });
  for (const t of [status, dtypeA === dtypeB ? dtypeA : `${dtypeA} vs ${dtypeB}`, "[" + shape.join(", ") + "]",
                   `${differing} element(s) outside the tolerances`, `max abs ${num(maxAbs)}`, `max rel ${num(maxRel)}`]) {
    facts.appendChild(el("span", {}, String(t)));
  }
  target.appendChild(facts);
  if (!grid) {
    target.appendChild(el("div", { class: "note", id: "no-grid" }, status === "shape" ? "the shapes differ: values not compared"
      : "every byte equal (identical)"));
    return;
  }
  const rows = grid.row_edges.length - 1, cols = grid.col_edges.length - 1;
  const width = Math.max(300, Math.min(900, (target.clientWidth || 900) - 12));
  const cw = width / cols, ch = Math.max(8, Math.min(28, (width / cols) * 0.6));
  const svg = el("svg", { width: width + 2, height: rows * ch + 2, class: "errors", "data-tensor": name }, null, SVG);
  const across = shape.length > 1 ? `elements ${"[" + shape.slice(1).join("x") + "]"} flattened` : "";
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const abs = grid.max_abs[r][c], rel = grid.max_rel[r][c], n = grid.differing[r][c];
      const where = `rows ${grid.row_edges[r]}:${grid.row_edges[r + 1]}` +
        (shape.length > 1 ? `, ${across} ${grid.col_edges[c]}:${grid.col_edges[c + 1]}` : "");
      const rect = el("rect", { x: 1 + c * cw, y: 1 + r * ch, width: Math.max(cw - 0.5, 0.5), height: ch - 0.5,
                                fill: blockColour(rel, n), class: "cell", "data-row": r, "data-col": c,
                                "data-max-abs": abs, "data-max-rel": rel, "data-differing": n }, null, SVG);
      svg.appendChild(tipped(rect, `${where}\nmax abs ${num(abs)}\nmax rel ${num(rel)}\n${n} outside the tolerances`));
    }
  }
  target.appendChild(svg);
  target.appendChild(el("div", { class: "note" },
    "grey: equal; yellow: different but within the tolerances; red: outside them (darker: larger relative error)"));
}

async function main() {
  const started = performance.now();
  const data = JSON.parse(document.getElementById("data").textContent);
  const pane = el("div", { id: "diff" }), extra = el("div", { id: "others" });
  const badge = (row) => (row[1] === "differ" || row[1] === "shape" ? row[1] : "");
  frame(data, data.tensors.map((t) => t[0]), (name) => badge(data.tensors.find((t) => t[0] === name)),
        (i) => drawDiff(data, data.tensors[i], pane), [pane, extra]);
  for (const [label, names] of [["only in A", data.only_a], ["only in B", data.only_b]]) {
    if (!names.length) continue;
    extra.appendChild(el("h2", {}, `${label} (${names.length})`));
    const list = el("ol", { class: label.replace(/ /g, "-") });
    for (const name of names.slice(0, 500)) list.appendChild(el("li", {}, name));
    extra.appendChild(list);
  }
  const changed = data.values.filter((v) => !v.equal);
  if (changed.length) {
    extra.appendChild(el("h2", {}, `values that differ (${changed.length})`));
    const list = el("ol", { class: "values" });
    for (const v of changed) list.appendChild(el("li", {}, `${v.name}: ${v.a} vs ${v.b}`));
    extra.appendChild(list);
  }
  ready(started);
}

run(main);
