// The browser side of nbscaler's space chart (an anywidget ES module, no bundler).
//
// Python draws the scatter as SVG (model.svg), each configuration a <g class="nbs-point"
// data-row="N"> with its hover text in a <title>. This module only inserts that SVG and turns a
// click on a point into a change of `selected` (the row of the sweep's table).

function render({ model, el }) {
  el.classList.add("nbs-spaceview");
  const chart = document.createElement("div");
  chart.className = "nbs-space-chart";
  el.append(chart);

  function draw() {
    chart.innerHTML = model.get("svg");
  }

  chart.addEventListener("click", (event) => {
    const point = event.target.closest(".nbs-point");
    if (!point) return;
    model.set("selected", Number(point.dataset.row));
    model.save_changes();
  });
  model.on("change:svg", draw);
  draw();
}

export default { render };
