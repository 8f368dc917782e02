// The browser side of nbscaler's GraphView (an anywidget ES module, no bundler).
//
// Python lays out and draws every pane as SVG (model.svgs) and names the boxes to highlight
// (model.marks). This module only inserts that SVG and turns clicks and typing into changes of the
// shared state: a module box toggles `expanded`, a frame's label collapses it, an op box sets
// `selected`, the search box sets `search`, the pane checkboxes set `panes`.

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function toggleExpanded(model, key) {
  const open = new Set(model.get("expanded"));
  if (open.has(key)) {
    for (const path of [...open]) if (path === key || path.startsWith(key + ".")) open.delete(path);
  } else {
    open.add(key);
  }
  model.set("expanded", [...open].sort());
  model.save_changes();
}

function scrollWithin(pane, target) {
  // Bring `target` into view inside the pane's own scroll box (never scroll the notebook page).
  const box = target.getBoundingClientRect();
  const frame = pane.getBoundingClientRect();
  if (box.top < frame.top + 24 || box.bottom > frame.bottom) pane.scrollTop += box.top - frame.top - frame.height / 3;
  if (box.left < frame.left || box.right > frame.right) pane.scrollLeft += box.left - frame.left - frame.width / 3;
}

function toolbar(model, onSearch) {
  const bar = element("div", "nbs-toolbar");
  const search = element("input", "nbs-search");
  search.type = "search";
  search.placeholder = "search: op name, module path or target";
  search.value = model.get("search");
  let timer = null;
  search.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => onSearch(search.value), 150);
  });
  const count = element("span", "nbs-count");
  const reset = element("button", "nbs-reset", "collapse all");
  reset.addEventListener("click", () => model.send({ type: "reset" }));
  const toggles = element("span", "nbs-pane-toggles");
  bar.append(search, count, reset, toggles);
  return { bar, search, count, toggles };
}

function render({ model, el }) {
  el.classList.add("nbs-graphview");
  const tools = toolbar(model, (text) => {
    model.set("search", text);
    model.save_changes();
  });
  const legend = element("div", "nbs-legend-slot");
  const panes = element("div", "nbs-panes");
  const details = element("div", "nbs-details-panel");
  const info = element("div", "nbs-info");
  el.append(tools.bar, legend, panes, details, info);

  function drawToggles() {
    tools.toggles.replaceChildren();
    const shown = new Set(model.get("panes"));
    for (const name of model.get("pane_names")) {
      const label = element("label", "nbs-pane-toggle");
      const box = element("input");
      box.type = "checkbox";
      box.checked = shown.has(name);
      box.dataset.pane = name;
      box.addEventListener("change", () => {
        const want = model.get("pane_names").filter((p) =>
          p === name ? box.checked : model.get("panes").includes(p));
        model.set("panes", want.length ? want : ["logical"]);
        model.save_changes();
      });
      label.append(box, document.createTextNode(" " + name));
      tools.toggles.append(label);
    }
  }

  function drawPanes() {
    const svgs = model.get("svgs");
    const scroll = {};
    for (const pane of panes.querySelectorAll(".nbs-pane")) scroll[pane.dataset.pane] = [pane.scrollTop, pane.scrollLeft];
    panes.replaceChildren();
    for (const name of model.get("panes")) {
      if (!(name in svgs)) continue;
      const pane = element("div", "nbs-pane");
      pane.dataset.pane = name;
      const title = element("div", "nbs-pane-title", name);
      const body = element("div", "nbs-pane-body");
      body.innerHTML = svgs[name];
      pane.append(title, body);
      panes.append(pane);
      if (scroll[name]) [pane.scrollTop, pane.scrollLeft] = scroll[name];
    }
    applyMarks();
  }

  function applyMarks(scroll = false) {
    const marks = model.get("marks") || {};
    for (const [kind, cls] of [["selected", "nbs-selected"], ["hits", "nbs-hit"]]) {
      for (const node of panes.querySelectorAll("." + cls)) node.classList.remove(cls);
      for (const key of marks[kind] || []) {
        for (const node of panes.querySelectorAll(`.nbs-box[data-key="${CSS.escape(key)}"]`)) {
          node.classList.add(cls);
          if (scroll && kind === "selected") scrollWithin(node.closest(".nbs-pane"), node);
        }
      }
    }
    const found = model.get("matches").length;
    tools.count.textContent = model.get("search") ? `${found} op${found === 1 ? "" : "s"} found` : "";
  }

  panes.addEventListener("click", (event) => {
    const label = event.target.closest(".nbs-frame-label");
    if (label) {
      toggleExpanded(model, label.closest(".nbs-frame").dataset.key);
      return;
    }
    const box = event.target.closest(".nbs-box");
    if (!box) return;
    if (box.dataset.node !== undefined) {
      model.set("selected", parseInt(box.dataset.node, 10));
      model.save_changes();
    } else if (box.classList.contains("nbs-module")) {
      toggleExpanded(model, box.dataset.key);
    }
  });

  model.on("change:svgs", drawPanes);
  model.on("change:panes", drawToggles);
  model.on("change:pane_names", drawToggles);
  model.on("change:marks", () => applyMarks(true));
  model.on("change:matches", () => applyMarks(false));
  model.on("change:details", () => { details.innerHTML = model.get("details"); });
  model.on("change:legend", () => { legend.innerHTML = model.get("legend"); });
  model.on("change:info", () => { info.textContent = model.get("info"); });
  model.on("change:search", () => {
    if (tools.search.value !== model.get("search")) tools.search.value = model.get("search");
  });

  drawToggles();
  drawPanes();
  details.innerHTML = model.get("details");
  legend.innerHTML = model.get("legend");
  info.textContent = model.get("info");
}

export default { render };
