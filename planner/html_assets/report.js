// soap-planner's HTML report: draws the plan from the JSON block #plan-data.
// Every string from the plan enters the page as text (textContent), never as markup.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("plan-data").textContent);
  const root = document.getElementById("report");
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = String(text);
    return node;
  }
  function tip(node, text) { const title = svg("title"); title.textContent = text; node.append(title); return node; }
  function section(id, title, ...children) {
    const box = el("section", { id: id }, el("h2", {}, title), ...children);
    root.append(box);
    return box;
  }
  function seconds(value) {
    if (value >= 1) return value.toFixed(3) + " s";
    if (value >= 1e-3) return (value * 1e3).toFixed(3) + " ms";
    return (value * 1e6).toFixed(1) + " µs";
  }
  function bytes(value) {
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, scale] of units) if (Math.abs(value) >= scale) return (value / scale).toFixed(2) + " " + unit;
    return value.toFixed(0) + " B";
  }
  function legend(items) {
    return el("div", { class: "legend" }, ...items.map(([color, label]) =>
      el("span", {}, el("i", { style: "background:" + color }), label)));
  }

  // --- verdict, findings, details -------------------------------------------------------
  function header() {
    root.append(el("h1", {}, data.title));
    const s = data.summary;
    const kpis = el("div", { class: "kpis" },
      el("div", { class: "kpi" }, "step time", el("b", {}, seconds(s.step_s))),
      el("div", { class: "kpi" }, "MFU", el("b", {}, (s.mfu * 100).toFixed(1) + "%")),
      el("div", { class: "kpi" }, "memory, fullest device", el("b", {}, bytes(s.memory) + " of " + bytes(s.capacity))),
      el("div", { class: "kpi" }, "exposed communication", el("b", {}, seconds(s.communication_s))),
      el("div", { class: "kpi" }, "fits", el("b", {}, s.fits ? "yes" : "NO")));
    section("verdict", "Verdict", el("p", { class: "verdict" }, data.verdict), kpis,
      ...data.notes.map((note) => el("div", { class: note.kind }, note.text)));
    const list = el("dl", { class: "details" });
    for (const [label, text] of data.details) list.append(el("dt", {}, label), el("dd", {}, text));
    section("details", "Details", list);
  }

  // --- strategy tree -------------------------------------------------------------------------
  function strategyTree() {
    const tree = { children: new Map(), ops: [], share: 0 };
    for (const row of data.modules) {
      let node = tree;
      node.share += row.share;
      for (const part of (row.module ? row.module.split(".") : ["<root>"])) {
        if (!node.children.has(part)) node.children.set(part, { children: new Map(), ops: [], share: 0 });
        node = node.children.get(part);
        node.share += row.share;
      }
      node.ops.push(row);
    }
    const box = el("div", { class: "tree" });
    function draw(parent, name, node, depth) {
      const moved = countReshards(node);
      const summary = el("summary", {}, name, el("span", { class: "share" }, "  " + (node.share * 100).toFixed(1) + "% of compute"));
      if (moved) summary.append(el("span", { class: "badge" }, moved + " redistributed"));
      const details = el("details", { "data-text": textOf(name, node) }, summary);
      if (depth < 1) details.open = true;
      for (const [child, sub] of node.children) draw(details, child, sub, depth + 1);
      for (const op of node.ops) {
        const line = el("div", { class: "op", "data-text": (op.module + " " + op.node + " " + op.op + " " + op.placement + " " + op.weights).toLowerCase() },
          op.node + "  " + op.op + ": " + op.placement + (op.weights ? "; " + op.weights : ""));
        if (op.reshards) line.append(el("span", { class: "badge" }, op.reshards + " input" + (op.reshards > 1 ? "s" : "") + " redistributed"));
        if (op.layout) line.append(el("span", { class: "badge layout" }, op.layout));
        details.append(line);
      }
      parent.append(details);
    }
    for (const [name, node] of tree.children) draw(box, name, node, 0);
    const filter = el("input", { class: "filter", type: "search", placeholder: "filter ops: a module, an op, a placement such as S(0)" });
    filter.addEventListener("input", () => {
      const wanted = filter.value.trim().toLowerCase();
      for (const op of box.querySelectorAll(".op")) op.style.display = !wanted || op.dataset.text.includes(wanted) ? "" : "none";
      for (const details of box.querySelectorAll("details")) {
        const hit = !wanted || details.dataset.text.includes(wanted);
        details.style.display = hit ? "" : "none";
        if (wanted && hit) details.open = true;
      }
    });
    section("strategy", "Strategy by module (S(d): shard dim d, R: replicate, P: partial; one placement per mesh axis)",
      filter, box);
  }
  function countReshards(node) {
    let total = node.ops.reduce((sum, op) => sum + op.reshards, 0);
    for (const sub of node.children.values()) total += countReshards(sub);
    return total;
  }
  function textOf(name, node) {
    const parts = [name];
    for (const op of node.ops) parts.push(op.module, op.node, op.op, op.placement, op.weights);
    for (const [child, sub] of node.children) parts.push(textOf(child, sub));
    return parts.join(" ").toLowerCase();
  }

  // --- timeline ----------------------------------------------------------------------------
  function timeline() {
    const t = data.timeline;
    if (!t.lanes.length) {
      section("timeline", "Simulated step", el("p", { class: "muted" },
        "No timeline in this file: `planner report PLAN --html` simulates the plan to draw one."));
      return;
    }
    const laneHeight = 22, labelWidth = 190, width = 1180, top = 18;
    const height = top + t.lanes.length * laneHeight + 24;
    let view = [0, t.end_s];
    const chart = svg("svg", { width: "100%", viewBox: `0 0 ${width} ${height}`, role: "img" });
    const plot = svg("g");
    chart.append(plot);
    function draw() {
      plot.replaceChildren();
      const span = view[1] - view[0];
      const x = (time) => labelWidth + (time - view[0]) / span * (width - labelWidth - 10);
      t.lanes.forEach((lane, index) => {
        const y = top + index * laneHeight;
        plot.append(svg("rect", { x: 0, y: y, width: width, height: laneHeight, fill: index % 2 ? "#fafbfc" : "#ffffff" }));
        plot.append(svg("text", { x: 4, y: y + 15 }, lane.device + " · " + lane.stream));
        const color = lane.compute ? "var(--compute)" : (/send|recv|p2p/.test(lane.stream) ? "var(--send)" : "var(--comm)");
        for (const [start, length, name] of lane.events) {
          if (start + length < view[0] || start > view[1]) continue;
          const left = Math.max(x(start), labelWidth), right = Math.min(x(start + length), width - 10);
          const rect = svg("rect", { x: left, y: y + 3, width: Math.max(0.6, right - left), height: laneHeight - 6, fill: color, class: "event" });
          plot.append(tip(rect, name + ": " + seconds(length) + " from " + seconds(start)));
        }
        const exposed = (t.exposed[lane.device] || []);
        if (!lane.compute && index === t.lanes.findIndex((other) => other.device === lane.device && !other.compute)) {
          for (const [start, length] of exposed) {
            if (start + length < view[0] || start > view[1]) continue;
            const left = Math.max(x(start), labelWidth), right = Math.min(x(start + length), width - 10);
            plot.append(tip(svg("rect", { x: left, y: y + laneHeight - 4, width: Math.max(0.6, right - left), height: 3, fill: "var(--exposed)", class: "exposed" }),
              "exposed communication: " + seconds(length)));
          }
        }
      });
      for (let tick = 0; tick <= 4; tick++) {
        const time = view[0] + span * tick / 4;
        plot.append(svg("text", { x: x(time) - (tick === 4 ? 40 : 0), y: 12 }, seconds(time)));
      }
    }
    function zoom(factor, centre) {
      const span = (view[1] - view[0]) * factor;
      const middle = centre === undefined ? (view[0] + view[1]) / 2 : centre;
      view = [Math.max(0, middle - span / 2), Math.min(t.end_s, middle + span / 2)];
      if (view[1] - view[0] < 1e-9) view = [view[0], view[0] + 1e-9];
      draw();
    }
    chart.addEventListener("wheel", (event) => {
      event.preventDefault();
      const box = chart.getBoundingClientRect();
      const fraction = Math.min(1, Math.max(0, ((event.clientX - box.left) / box.width * width - labelWidth) / (width - labelWidth - 10)));
      zoom(event.deltaY < 0 ? 0.7 : 1 / 0.7, view[0] + fraction * (view[1] - view[0]));
    }, { passive: false });
    const controls = el("div", { class: "controls" },
      button("zoom in", () => zoom(0.5)), button("zoom out", () => zoom(2)), button("whole step", () => { view = [0, t.end_s]; draw(); }),
      el("span", { class: "muted" }, " or scroll over the chart"));
    draw();
    section("timeline", "Simulated step per device and stream (one row per pipeline stage's devices)",
      legend([["var(--compute)", "compute"], ["var(--comm)", "collectives"], ["var(--send)", "pipeline sends"],
        ["var(--exposed)", "exposed communication (no compute hides it)"]]), controls, chart);
  }
  function button(label, action) { const b = el("button", { type: "button" }, label); b.addEventListener("click", action); return b; }

  // --- memory and bytes ----------------------------------------------------------------------
  function memory() {
    const m = data.memory;
    const colors = ["#3b7dd8", "#7aa7e8", "#2e9d5b", "#e08a2e", "#8a5cc7"];
    const width = 900, barHeight = 26, labelWidth = 120, top = 8;
    const most = Math.max(m.capacity, ...m.bars.map((bar) => m.kinds.reduce((sum, kind) => sum + bar[kind], 0)));
    const height = top + m.bars.length * (barHeight + 10) + 20;
    const chart = svg("svg", { width: "100%", viewBox: `0 0 ${width} ${height}`, role: "img" });
    const x = (value) => labelWidth + value / most * (width - labelWidth - 110);
    m.bars.forEach((bar, index) => {
      const y = top + index * (barHeight + 10);
      chart.append(svg("text", { x: 4, y: y + 17 }, bar.name));
      let start = 0;
      m.kinds.forEach((kind, k) => {
        const rect = svg("rect", { x: x(start), y: y, width: Math.max(0, x(start + bar[kind]) - x(start)), height: barHeight, fill: colors[k], class: "memory-part" });
        chart.append(tip(rect, kind.replace("_", " ") + ": " + bytes(bar[kind])));
        start += bar[kind];
      });
      chart.append(svg("text", { x: x(start) + 4, y: y + 17 }, bytes(start)));
    });
    chart.append(svg("line", { x1: x(m.capacity), x2: x(m.capacity), y1: 0, y2: height - 14, stroke: "var(--exposed)", "stroke-dasharray": "4 3" }));
    chart.append(svg("text", { x: x(m.capacity) - 170, y: height - 4 }, "device memory " + bytes(m.capacity)));
    const axes = el("table", {}, el("tr", {}, el("th", {}, "mesh axis"), el("th", { class: "num" }, "bytes sent per device per step")));
    for (const [axis, sent] of Object.entries(data.bytes_per_axis)) axes.append(el("tr", {}, el("td", {}, axis), el("td", { class: "num" }, bytes(sent))));
    section("memory", "Memory per device, by kind, against the device's capacity",
      legend(m.kinds.map((kind, k) => [colors[k], kind.replace("_", " ")])), chart, el("h2", {}, "Bytes per mesh axis"), axes);
  }

  // --- candidates ----------------------------------------------------------------------------
  function candidates() {
    const rows = data.candidates;
    if (rows.length < 2) return;
    const width = 900, height = 380, left = 80, bottom = 40, capacity = data.summary.capacity;
    const maxMemory = Math.max(capacity * 1.05, ...rows.map((row) => row.memory)) * 1.05;
    const times = rows.map((row) => row.step_s);
    const low = Math.min(...times) * 0.95, high = Math.max(...times) * 1.05;
    const x = (memory) => left + memory / maxMemory * (width - left - 20);
    const y = (time) => height - bottom - (time - low) / (high - low || 1) * (height - bottom - 40);
    const chart = svg("svg", { width: "100%", viewBox: `0 0 ${width} ${height}`, role: "img" });
    chart.append(svg("line", { x1: left, x2: width - 10, y1: height - bottom, y2: height - bottom, stroke: "#999" }));
    chart.append(svg("line", { x1: left, x2: left, y1: 24, y2: height - bottom, stroke: "#999" }));
    chart.append(svg("line", { x1: x(capacity), x2: x(capacity), y1: 10, y2: height - bottom, stroke: "var(--exposed)", "stroke-dasharray": "5 4", class: "fit-line" }));
    chart.append(svg("text", { x: x(capacity) + 4, y: 22 }, "fits ← | → does not fit (" + bytes(capacity) + ")"));
    chart.append(svg("text", { x: left, y: height - 8 }, "memory on the fullest device →"));
    chart.append(svg("text", { x: 4, y: 16 }, "step time ↑"));
    for (let tick = 0; tick <= 4; tick++) {
      const time = low + (high - low) * tick / 4;
      chart.append(svg("text", { x: 4, y: y(time) + 4 }, seconds(time)));
    }
    for (const row of rows) {
      const dot = svg("circle", { cx: x(row.memory), cy: y(row.step_s), r: row.chosen ? 8 : 5,
        fill: row.chosen ? "var(--fits)" : (row.fits ? "#7aa7e8" : "#c9ccd3"), stroke: row.chosen ? "#114d2a" : "none", "stroke-width": 2, class: "candidate" });
      chart.append(tip(dot, (row.chosen ? "CHOSEN: " : "") + row.name + (row.route ? " (" + row.route + ")" : "") + " · " + seconds(row.step_s) + " · " + bytes(row.memory)));
      if (row.chosen) chart.append(svg("text", { x: x(row.memory) + 10, y: y(row.step_s) + 4 }, "chosen"));
    }
    section("candidates", "The plans the search considered: step time against memory",
      legend([["var(--fits)", "chosen"], ["#7aa7e8", "fits"], ["#c9ccd3", "does not fit"]]), chart);
  }

  // --- MoE loads, pipeline map, SUMMA grids ---------------------------------------------------
  function moe() {
    if (!data.moe.length) return;
    const box = el("div", { class: "grid-row" });
    for (const layer of data.moe) {
      const devices = layer.after.length, width = 40 + devices * 22, height = 150;
      const most = Math.max(...layer.before, ...layer.after) || 1;
      const chart = svg("svg", { width: width, height: height, role: "img" });
      layer.before.forEach((load, device) => {
        const h = load / most * (height - 40), g = layer.after[device] / most * (height - 40);
        chart.append(tip(svg("rect", { x: 30 + device * 22, y: height - 20 - h, width: 9, height: h, fill: "#c9ccd3", class: "moe-load" }), "device " + device + " round-robin: " + (load * 100).toFixed(1) + "%"));
        chart.append(tip(svg("rect", { x: 40 + device * 22, y: height - 20 - g, width: 9, height: g, fill: "var(--compute)", class: "moe-load" }), "device " + device + " as placed: " + (layer.after[device] * 100).toFixed(1) + "%"));
      });
      chart.append(svg("text", { x: 2, y: height - 4 }, "devices 0.." + (devices - 1)));
      box.append(el("div", {}, el("div", {}, layer.module), chart));
    }
    section("moe", "MoE: routed tokens per device, round-robin (grey) and as placed (blue)", box);
  }
  function pipeline() {
    const p = data.pipeline;
    if (!p) return;
    const table = el("table", {}, el("tr", {}, el("th", {}, "devices of stage"), el("th", {}, "chunk"), el("th", {}, "modules")));
    for (const chunk of p.chunks) table.append(el("tr", {}, el("td", {}, "stage " + chunk.rank_stage), el("td", {}, String(chunk.module_stage)), el("td", {}, chunk.contents)));
    section("pipeline", "Pipeline: " + p.stages + " stages, " + p.schedule + ", " + p.micro_batches + " micro-batches" +
      (p.virtual > 1 ? ", " + p.virtual + " virtual stages each" : ""), table);
  }
  function summa() {
    const s = data.summa;
    if (!s) return;
    const box = el("div", { class: "grid-row" });
    for (const grid of s.grids) {
      const rows = grid.cells.length, cols = grid.cells[0].length, cell = 34;
      const chart = svg("svg", { width: cols * cell + 2, height: rows * cell + 2, role: "img" });
      grid.cells.forEach((row, r) => row.forEach((rank, c) => {
        chart.append(svg("rect", { x: 1 + c * cell, y: 1 + r * cell, width: cell - 2, height: cell - 2, fill: "#e8eef9", stroke: "#3b7dd8", class: "summa-cell" }));
        chart.append(svg("text", { x: 1 + c * cell + 10, y: 1 + r * cell + 21 }, rank));
      }));
      box.append(el("div", {}, el("div", {}, grid.label + " (rows × columns)"), chart));
    }
    const families = el("p", {}, "Layers by layout: " + s.families.map(([family, count]) => family + " × " + count).join(", "));
    section("summa", "SUMMA grids: which rank holds which block", box, families);
  }

  // --- measured against predicted ---------------------------------------------------------------
  function measured() {
    if (!data.measured) return;
    const table = el("table", {}, el("tr", {}, el("th", {}, "part"), el("th", { class: "num" }, "predicted"), el("th", { class: "num" }, "measured"), el("th", { class: "num" }, "error")));
    for (const part of data.measured) {
      const error = part.measured_s > 0 ? ((part.predicted_s / part.measured_s - 1) * 100).toFixed(1) + "%" : "-";
      table.append(el("tr", {}, el("td", {}, part.name), el("td", { class: "num" }, seconds(part.predicted_s)), el("td", { class: "num" }, seconds(part.measured_s)), el("td", { class: "num" }, error)));
    }
    section("measured", "Predicted against measured, per op class and collective (rank 0)", table);
  }

  // --- the text report's tables -------------------------------------------------------------------
  function tables() {
    const box = el("div");
    for (const t of data.tables) {
      if (t.section === "strategy") continue;  // drawn as the tree above
      const table = el("table", {}, el("tr", {}, ...t.columns.map((column) => el("th", {}, column))));
      for (const row of t.rows) table.append(el("tr", {}, ...row.map((cell) => el("td", {}, cell))));
      box.append(el("h2", {}, t.title), table);
    }
    section("tables", "The report's tables", box);
  }

  header();
  strategyTree();
  timeline();
  memory();
  candidates();
  moe();
  pipeline();
  summa();
  measured();
  tables();
})();
