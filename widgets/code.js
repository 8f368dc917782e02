// The browser side of nbscaler's CodeView (an anywidget ES module, no bundler).
//
// Python sends the shown rank's file already highlighted (model.html, each line a
// <span id="nbs-line-N">) and the lines to mark (model.lines). This module draws the rank selector,
// marks those lines and scrolls the code box (never the page) to the first of them.

function render({ model, el }) {
  el.classList.add("nbs-codeview");
  const head = document.createElement("div");
  head.className = "nbs-code-head";
  const select = document.createElement("select");
  select.className = "nbs-rank";
  const caption = document.createElement("span");
  caption.className = "nbs-code-caption";
  head.append(select, caption);
  const body = document.createElement("div");
  body.className = "nbs-code-body";
  el.append(head, body);

  function drawRanks() {
    select.replaceChildren();
    for (const rank of model.get("ranks")) {
      const option = document.createElement("option");
      option.value = String(rank);
      option.textContent = `rank ${rank}`;
      select.append(option);
    }
    select.value = String(model.get("rank"));
  }

  function markLines() {
    for (const line of body.querySelectorAll(".nbs-code-marked")) line.classList.remove("nbs-code-marked");
    const lines = model.get("lines");
    for (const n of lines) {
      const span = body.querySelector(`[id="nbs-line-${n}"]`);
      if (span) span.classList.add("nbs-code-marked");
    }
    const first = lines.length ? body.querySelector(`[id="nbs-line-${lines[0]}"]`) : null;
    if (first) {
      const top = first.getBoundingClientRect().top - body.getBoundingClientRect().top;
      body.scrollTop += top - body.clientHeight / 3;
    }
  }

  select.addEventListener("change", () => {
    model.set("rank", parseInt(select.value, 10));
    model.save_changes();
  });
  model.on("change:ranks", drawRanks);
  model.on("change:rank", () => { select.value = String(model.get("rank")); });
  model.on("change:html", () => { body.innerHTML = model.get("html"); markLines(); });
  model.on("change:lines", markLines);
  model.on("change:caption", () => { caption.textContent = model.get("caption"); });

  drawRanks();
  body.innerHTML = model.get("html");
  caption.textContent = model.get("caption");
  markLines();
}

export default { render };
