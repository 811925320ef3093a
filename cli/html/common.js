// What every page of hpckpt shares: its JSON data, expanding compressed columns, colours of
// ranks, sizes in binary units, DOM helpers (text only: a name from a checkpoint never becomes
// markup), and the hover tip.
"use strict";

const SVG = "http://www.w3.org/2000/svg";  // the namespace name, not an address anything loads

async function inflate(b64, Type) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Type(await new Response(stream).arrayBuffer());
}

function colour(rank) {
  if (rank < 0) return "#9aa3ad";
  return `hsl(${(210 + rank * 137.508) % 360}, 62%, ${48 + (rank % 3) * 8}%)`;
}

function human(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function el(tag, attrs = {}, text = null, ns = null) {
  const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

function region(offsets, sizes) {
  return "[" + offsets.map((o, d) => `${o}:${o + sizes[d]}`).join(", ") + "]";
}

function parseRegion(text) {  // "[0:2, 4:8]" -> [[0, 4], [2, 4]]
  const parts = text.replace(/[\[\]]/g, "").split(",").map((p) => p.trim().split(":").map(Number));
  return [parts.map((p) => p[0]), parts.map((p) => p[1] - p[0])];
}

const tip = el("div", { id: "tip" });
function showTip(event, text) {
  tip.textContent = text;
  tip.style.display = "block";
  tip.style.left = event.clientX + 12 + "px";
  tip.style.top = event.clientY + 12 + "px";
}
function hideTip() { tip.style.display = "none"; }
function tipped(node, text) {
  node.addEventListener("mousemove", (e) => showTip(e, text));
  node.addEventListener("mouseleave", hideTip);
  node.appendChild(el("title", {}, text, SVG));
  return node;
}


// The page's frame: a header (title, facts), a searchable list of `names` (with a `badge(name)`
// where it says something), and a view showing `parts`; `show(i)` draws name i, chosen by a
// click or by `#t=NAME` in the address.
function frame(data, names, badge, show, parts) {
  document.body.appendChild(tip);
  const header = el("header");
  header.appendChild(el("h1", {}, data.meta.title));
  const facts = el("div", { class: "facts" });
  for (const t of data.meta.facts) facts.appendChild(el("span", {}, t));
  header.appendChild(facts);
  const main = el("main"), nav = el("nav"), view = el("section");
  const search = el("input", { type: "search", placeholder: "search tensor names", id: "search" });
  const count = el("div", { class: "count" }), list = el("ol", { id: "tensors" });
  nav.append(search, count, list);
  view.append(...parts);
  main.append(nav, view);
  document.body.append(header, main);
  const wanted = decodeURIComponent((location.hash.match(/^#t=(.*)$/) || [])[1] || data.meta.selected || "");
  let selected = Math.max(0, names.indexOf(wanted));
  const select = (i) => {
    selected = i;
    show(i);
    for (const li of list.children) li.classList.toggle("selected", Number(li.dataset.index) === i);
  };
  const fill = () => {
    const q = search.value.toLowerCase();
    list.replaceChildren();
    let matched = 0;
    names.forEach((name, i) => {
      if (q && !name.toLowerCase().includes(q)) return;
      matched += 1;
      if (matched > 2000) return;
      const li = el("li", { "data-index": i }, name);
      const said = badge(name);
      if (said) li.appendChild(el("span", { class: "bad" }, "  " + said));
      li.classList.toggle("selected", i === selected);
      li.addEventListener("click", () => select(i));
      list.appendChild(li);
    });
    count.textContent = `${matched} of ${names.length} tensors` + (matched > 2000 ? " (first 2000 listed)" : "");
  };
  search.addEventListener("input", fill);
  fill();
  if (names.length) select(selected);
}

function ready(started) {
  document.body.dataset.renderMs = String(Math.round(performance.now() - started));
  document.body.dataset.ready = "true";
}

function run(main) {
  main().catch((e) => { document.body.dataset.error = String(e); document.body.append(el("pre", {}, String(e))); });
}
