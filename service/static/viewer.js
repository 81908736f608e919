// meshplan plan viewer: plain DOM, no build step, no network beyond this origin.
// Every value from a plan is written with textContent (never innerHTML).
"use strict";

// A rank tile's fill, by its outermost coordinate: hues a golden angle apart, so no two
// neighbouring blocks look alike however many there are (8 fixed colours repeated), dark
// enough that the tile's white text reads at >= 5:1 whatever the hue.
const rankColour = (c) => `hsl(${((215 + c * 137.508) % 360).toFixed(1)} 60% 28%)`;  // blue first
const MAX_RANKS_DRAWN = 1024;
// The grid wraps a long last dim (a 1-D dp=1024 mesh would be one row as wide as 1024 cells).
const MAX_GRID_COLUMNS = 16;
// A process group is shown by its first members and its last, with its size.
const GROUP_MEMBERS_SHOWN = 3;
// Plans per page of the list (GET /v1/plans takes at most 1000); `/?limit=N&offset=M` pages.
const PLANS_PER_PAGE = 200;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// The largest binary unit that keeps the value at one or more, as the CLI prints it
// (planner.schema.binary_size).
const fmtBytes = (b) => {
  for (const [unit, size] of [["TiB", 1024 ** 4], ["GiB", 1024 ** 3], ["MiB", 1024 ** 2], ["KiB", 1024]]) {
    if (Math.abs(b) >= size) return (b / size).toFixed(2) + " " + unit;
  }
  return b.toFixed(0) + " B";
};
const fmtShare = (part, whole) => {
  const pct = (100 * part) / Math.max(whole, 1);
  return pct > 0 && pct < 0.1 ? "<0.1%" : pct.toFixed(1) + "%";
};
const fmtS = (s) => (s === null || s === undefined ? "—" : s >= 1 ? s.toFixed(3) + " s" : (s * 1e3).toFixed(2) + " ms");
const meshText = (m) => Object.entries(m).map(([k, v]) => `${k}=${v}`).join(" × ");

function section(title, ...body) {
  return el("section", {}, el("h2", {}, title), ...body);
}

// ---- plan list --------------------------------------------------------------
function intParam(params, name, fallback) {
  // The server answered this page with a 422 for a value out of GET /v1/plans's bounds
  // (app.list_page), so what reaches here is an integer in them.
  return params.has(name) ? Number(params.get(name)) : fallback;
}

function pager(offset, limit, shown, total) {
  // Where this page is in the list, with links to the newer and older pages (`/?offset=N`).
  if (offset === 0 && shown >= total) return null;
  const page = (o) => `/?offset=${o}` + (limit === PLANS_PER_PAGE ? "" : `&limit=${limit}`);
  return el("p", { class: "muted", id: "plan-pager" },
    offset === 0 ? `showing the newest ${shown} of ${total} plans`
      : shown ? `showing plans ${offset + 1}–${offset + shown} of ${total}, newest first` : `no plans after the first ${total}`,
    offset > 0 ? [" · ", el("a", { href: page(Math.max(0, offset - limit)), id: "newer-plans" }, "← newer")] : null,
    offset + shown < total ? [" · ", el("a", { href: page(offset + limit), id: "older-plans" }, "older →")] : null);
}

async function showList(main) {
  const params = new URLSearchParams(location.search);
  const limit = intParam(params, "limit", PLANS_PER_PAGE);
  const offset = intParam(params, "offset", 0);
  const res = await fetch(`/v1/plans?limit=${limit}&offset=${offset}`);
  if (!res.ok) throw new Error(`GET /v1/plans: ${res.status}`);
  const data = await res.json();
  const rows = data.plans.map((p) => el("tr", {},
    el("td", {}, el("a", { href: `/plans/${p.id}`, class: "mono" }, p.id)),
    el("td", {}, p.model), el("td", { class: "num" }, p.devices), el("td", {}, p.profile),
    el("td", { class: "mono" }, meshText(p.mesh)), el("td", { class: "num" }, fmtS(p.step_time_s)),
    el("td", {}, new Date(p.created * 1000).toLocaleString())));
  main.replaceChildren(el("section", {}, el("h1", {}, `Plans (${data.total})`), pager(offset, limit, rows.length, data.total),
    rows.length ? el("table", { id: "plan-list" },
      el("thead", {}, el("tr", {}, ["id", "model", "devices", "profile", "mesh", "step time", "created"]
        .map((h) => el("th", {}, h)))),
      el("tbody", {}, rows))
      : el("p", { class: "muted", id: "plan-list" },
        data.total ? "No plans on this page." :
          "No plans yet: POST /v1/plans (schema: /openapi.json) or run `meshplan plan`, or open a plan.json above.")));
}

// ---- mesh -------------------------------------------------------------------
function coordsOf(rank, sizes) {
  const c = [];
  for (let i = sizes.length - 1; i >= 0; i--) { c[i] = rank % sizes[i]; rank = Math.floor(rank / sizes[i]); }
  return c;
}

function groupText(dim, sizes, g) {
  // Ranks that differ only in `dim` form one process group of that mesh dim.  Group g (in
  // the order of its lowest rank) is computed, not enumerated: a mesh may have 2^20 ranks.
  const stride = sizes.slice(dim + 1).reduce((a, b) => a * b, 1), n = sizes[dim];
  const base = Math.floor(g / stride) * n * stride + (g % stride);
  const member = (i) => base + i * stride;
  if (n <= GROUP_MEMBERS_SHOWN + 2) return `{${Array.from({ length: n }, (_, i) => member(i)).join(", ")}}`;
  const head = Array.from({ length: GROUP_MEMBERS_SHOWN }, (_, i) => member(i)).join(", ");
  return `{${head}, …, ${member(n - 1)}} (${n} ranks)`;
}

function meshSection(plan) {
  const dims = plan.mesh.dims, sizes = dims.map((d) => d.size), total = plan.mesh.dims.reduce((a, d) => a * d.size, 1);
  const last = sizes[sizes.length - 1], cols = Math.min(last, MAX_GRID_COLUMNS);
  const grid = el("div", { class: "mesh", id: "mesh-grid", style: { gridTemplateColumns: `repeat(${cols}, max-content)` } });
  for (let r = 0; r < Math.min(total, MAX_RANKS_DRAWN); r++) {
    const c = coordsOf(r, sizes);
    // Colour by the outermost dim's coordinate so its groups read as blocks.
    grid.append(el("div", { class: "rank", style: { background: rankColour(c[0]) },
      title: dims.map((d, i) => `${d.name}=${c[i]}`).join(", ") },
    `rank ${r}`, el("span", { class: "coord" }, dims.map((d, i) => `${d.name}${c[i]}`).join("·"))));
  }
  const groups = el("ul", { class: "groups" }, dims.map((d, i) => {
    const count = total / d.size;
    const mode = dpMode(plan, d.name);
    const shown = Array.from({ length: Math.min(count, 6) }, (_, g) => groupText(i, sizes, g)).join(" ");
    return el("li", {}, el("b", {}, `${d.name} (${d.size}${mode ? ", " + mode : ""})`),
      `: ${count} group${count > 1 ? "s" : ""} ${shown}${count > 6 ? " …" : ""}`);
  }));
  return section(`Device mesh: ${dims.map((d) => `${d.name}=${d.size}`).join(" × ")} (${plan.mesh.device_type}, ${total} devices)`,
    el("p", { class: "muted" }, "Ranks row-major: the last dim holds adjacent ranks (kept inside a node)."),
    grid, last > cols ? el("p", { class: "muted", id: "mesh-wrap-note" },
      `${cols} ranks per row: the ${last} ranks along ${dims[dims.length - 1].name} wrap over several rows`) : null,
    total > MAX_RANKS_DRAWN ? el("p", { class: "muted" }, `first ${MAX_RANKS_DRAWN} of ${total} ranks drawn`) : null, groups);
}

// ---- placements -------------------------------------------------------------
const dpMode = (plan, dim) => (plan.data_parallel.find((d) => d.dim === dim) || {}).mode;
// A 2-D weight whose dim 0 is not its output features, as a Linear's is: an embedding's
// [vocab, hidden] and GPT-2's Conv1D [in, out] (service/terminal.py's _input_dim_first).
const inputDimFirst = (fqn) => /(^|\.)(embed[a-z_]*|wte|wpe)\./.test(fqn) || /(^|\.)c_(attn|fc|proj)\.weight$/.test(fqn);

function stagesHolding(plan, fqn) {
  // The pipeline stages whose modules hold parameter `fqn` (a pattern: `*` is one path
  // component, so a repeated layer's entry is held by every stage with one of its layers).
  const parts = fqn.split(".");
  const holds = (module) => {
    const m = module.split(".");
    return m.length < parts.length && m.every((c, i) => parts[i] === "*" || parts[i] === c);
  };
  return plan.pipeline.stages.filter((st) => st.modules.some(holds)).map((st) => st.index);
}

function placementKind(placement, fqn, shape, plan, dimName) {
  // Names as torch's parallel styles use them: a Linear weight [out, in] sharded on
  // dim 0 is column-wise, on dim 1 row-wise; an Embedding [vocab, hidden] and GPT-2's
  // Conv1D [in, out] the reverse.
  // On a fully_shard data-parallel dim FSDP stores a shard whatever the logical placement.
  // On the pipeline dim a parameter is whole (R), but only on its stages' ranks.
  if (dpMode(plan, dimName) === "fully_shard") return ["fully sharded", "pl-fsdp", "fully sharded (FSDP)"];
  if (plan.pipeline && plan.pipeline.dim === dimName) {
    const st = stagesHolding(plan, fqn);
    const label = st.length === 1 ? `stage ${st[0]}` : st.length ? `stages ${st[0]}–${st[st.length - 1]}` : "no stage";
    return [label, "pl-stage", `whole on the ranks of ${label} only`];
  }
  if (placement === "R") return ["replicated", "pl-replicated", "replicated"];
  const d = Number(placement.slice(2, -1));
  if (shape && shape.length === 2 && d < 2) {
    const colwise = (d === 0) !== inputDimFirst(fqn);
    return colwise ? ["column-sharded", "pl-column", `column-wise: dim ${d} split`]
      : ["row-sharded", "pl-row", `row-wise: dim ${d} split`];
  }
  return [`sharded dim ${d}`, "pl-shard", `dim ${d} split`];
}

function localShape(plan, shape, placements) {
  // Explicit shards first, then FSDP's dim-0 split of what is left on fully_shard dims.
  if (!shape) return "?";
  const s = shape.slice(), dims = plan.mesh.dims;
  placements.forEach((p, i) => { if (p.startsWith("S(")) { const d = Number(p.slice(2, -1)); s[d] = Math.ceil(s[d] / dims[i].size); } });
  placements.forEach((p, i) => { if (p === "R" && dpMode(plan, dims[i].name) === "fully_shard") s[0] = Math.ceil(s[0] / dims[i].size); });
  return `[${s.join(", ")}]`;
}

function placementSection(plan) {
  const dims = plan.mesh.dims;
  const legend = el("div", { class: "legend" },
    [["replicated", "pl-replicated"], ["column-sharded", "pl-column"], ["row-sharded", "pl-row"],
      ["fully sharded", "pl-fsdp"], ["sharded (other dim)", "pl-shard"],
      ...(plan.pipeline ? [["pipeline stage", "pl-stage"]] : [])].map(([t, c]) => el("span", { class: `pl ${c}` }, t)));
  const rows = plan.parameters.map((p) => {
    const shape = plan.fingerprint.params[p.fqn];
    const count = plan.fingerprint.counts[p.fqn];
    return el("tr", {},
      el("td", { class: "mono" }, p.fqn),
      el("td", { class: "mono" }, shape ? `[${shape.join(", ")}]` : "?"),
      el("td", { class: "num" }, count ?? ""),
      p.placements.map((pl, i) => {
        const [label, cls, title] = placementKind(pl, p.fqn, shape, plan, dims[i].name);
        return el("td", {}, el("span", { class: `pl ${cls}`, title: `${pl}: ${title}` }, `${label} `, el("code", {}, pl)));
      }),
      el("td", { class: "mono" }, localShape(plan, shape, p.placements)));
  });
  const table = el("table", { id: "placement-table" },
    el("thead", {}, el("tr", {}, el("th", {}, "parameter"), el("th", {}, "shape"), el("th", { class: "num" }, "×"),
      dims.map((d) => el("th", {}, `${d.name} (${d.size})`)), el("th", {}, "local shard"))),
    el("tbody", {}, rows));
  const out = [legend, el("div", { class: "scroll" }, table)];
  if (plan.modules.length) {
    // one placement per mesh dim, in the mesh's order (a batch split over dp is S(0) there)
    out.push(el("h2", {}, `Activation layouts (per mesh dim: ${dims.map((d) => d.name).join(", ")})`),
      el("table", { id: "module-table" },
      el("thead", {}, el("tr", {}, ["module", "input", "output"].map((h) => el("th", {}, h)))),
      el("tbody", {}, plan.modules.map((m) => el("tr", {}, el("td", { class: "mono" }, m.module),
        el("td", { class: "mono" }, m.input ? m.input.join(", ") : "—"),
        el("td", { class: "mono" }, m.output ? m.output.join(", ") : "—"))))));
  }
  return section(`Parameter placements (${plan.parameters.length} entries; * = every repeated layer)`, ...out);
}

// ---- memory and time --------------------------------------------------------
function stackedBar(parts, scale, capacity) {
  const bar = el("div", { class: "bar" + (capacity !== undefined && parts.reduce((a, p) => a + p[1], 0) > capacity ? " over" : "") });
  for (const [name, v] of parts) {
    if (v > 0) bar.append(el("span", { class: `seg-${name}`, title: name, style: { width: `${(100 * v) / scale}%` } }));
  }
  if (capacity !== undefined) bar.append(el("span", { class: "capacity", title: "capacity", style: { left: `calc(${(100 * capacity) / scale}% - 1px)` } }));
  return bar;
}

function legendRow(parts, fmt) {
  return el("div", { class: "facts" }, parts.map(([name, v]) =>
    el("span", {}, el("span", { class: `swatch seg-${name}` }), `${name.replace(/_/g, " ")}: `, el("b", {}, fmt(v)))));
}

function memorySection(plan) {
  const m = plan.prediction.memory;
  const parts = [["parameters", m.parameters], ["gradients", m.gradients], ["optimizer", m.optimizer], ["activations", m.activations],
    ["fsdp_gathered", m.fsdp_gathered || 0]];
  const scale = Math.max(m.total, m.capacity, 1);
  return section("Memory per device (most loaded device)",
    el("div", { id: "memory-bar" }, stackedBar(parts, scale, m.capacity)), legendRow(parts, fmtBytes),
    el("p", { class: m.fits ? "muted" : "error" },
      `total ${fmtBytes(m.total)} of ${fmtBytes(m.capacity)} capacity (${fmtShare(m.total, m.capacity)})`,
      m.usable == null ? "" : `, ${fmtBytes(m.usable)} usable after the planner's headroom`,
      m.fits ? "" : " — does not fit"));
}

function timeSection(plan) {
  const t = plan.prediction.time, p = plan.prediction;
  // resharding is the blocking part of the exposed communication (cost_model.step): drawn
  // apart from the rest of it, so that the parts add up to the step
  const parts = [["compute", t.compute_s], ["resharding", t.resharding_s],
    ["other_exposed_communication", Math.max(0, t.exposed_communication_s - t.resharding_s)],
    ["pipeline_bubble", t.pipeline_bubble_s], ["optimizer_step", t.optimizer_s]];
  return section("Predicted step time",
    el("div", { class: "facts" }, el("span", {}, "step ", el("b", {}, fmtS(t.step_time_s))),
      el("span", {}, "tokens/s/device ", el("b", {}, Math.round(p.tokens_per_s_per_device).toLocaleString())),
      el("span", {}, "MFU ", el("b", {}, (100 * p.mfu).toFixed(1) + "%")),
      el("span", {}, "all communication (overlapped or not) ", el("b", {}, fmtS(t.communication_s))),
      t.recompute_s > 0 ? el("span", {}, "of the compute, recomputation ", el("b", {}, fmtS(t.recompute_s))) : null),
    el("div", { id: "time-bar" }, stackedBar(parts, Math.max(parts.reduce((a, q) => a + q[1], 0), t.step_time_s, 1e-12))),
    legendRow(parts, fmtS));
}

// A mesh the search's time limit came before: never priced, so its "fits" says nothing.
// The planner's note is "<mesh label>: skipped (time limit)" (planner.schema.SKIPPED_BY_TIME_LIMIT).
const skippedByTimeLimit = (a) => a.note.endsWith("skipped (time limit)");

function alternativesSection(plan) {
  const chosen = meshText(Object.fromEntries(plan.mesh.dims.map((d) => [d.name, d.size])));
  const alts = plan.solver.alternatives;
  if (!alts.length) return section("Alternatives considered", el("p", { class: "muted" }, "The search recorded no alternatives."));
  return section(`Alternatives considered (${alts.length})`, el("table", { id: "alternatives" },
    el("thead", {}, el("tr", {}, ["mesh", "step time", "peak memory", "fits", "note"].map((h) => el("th", {}, h)))),
    // Several alternatives may share a mesh (replicate vs FSDP, ...): the chosen one also has the plan's step time.
    el("tbody", {}, alts.map((a) => el("tr", { class: meshText(a.mesh) === chosen && a.step_time_s === plan.prediction.time.step_time_s ? "chosen" : "" },
      el("td", { class: "mono" }, meshText(a.mesh)), el("td", { class: "num" }, fmtS(a.step_time_s)),
      el("td", { class: "num" }, a.peak_memory_bytes === null ? "—" : fmtBytes(a.peak_memory_bytes)),
      el("td", {}, skippedByTimeLimit(a) ? "—" : a.fits ? "yes" : "no"), el("td", {}, a.note))))));
}

function solverSection(plan) {
  const s = plan.solver;
  const facts = [["solver", s.solver], ["status", s.status], ["variables", s.variables], ["constraints", s.constraints],
    ["solve time", fmtS(s.solve_time_s)], ["total planning time", fmtS(s.total_time_s)],
    ["objective", s.objective.toPrecision(6)], ["gap", s.gap === null ? "—" : s.gap]];
  const unsupported = Object.entries(s.unsupported_ops);
  const skipped = s.alternatives.filter(skippedByTimeLimit).length;
  return section("Solver", el("div", { class: "facts" }, facts.map(([k, v]) => el("span", {}, `${k} `, el("b", {}, v)))),
    s.notes.length ? el("ul", { id: "notes" }, s.notes.map((n) => el("li", {}, `Note: ${n}`))) : null,
    skipped ? el("p", { id: "time-limited" }, `The time limit ended the search: ${skipped} of ` +
      `${s.alternatives.length} alternatives were not tried (marked "skipped" above).`) : null,
    unsupported.length ? el("p", {}, "Ops with no sharding rule of their own (priced as element-wise in their segment's layout): ",
      el("span", { class: "mono" }, unsupported.map(([op, n]) => `${op} ×${n}`).join(", "))) : null);
}

function pipelineSection(plan) {
  const p = plan.pipeline;
  if (!p) return null;
  // Virtual stage s runs on pp rank s % pp (executor.pipeline); a plan that lists one
  // stage per rank with virtual_stages > 1 has each rank's layers dealt out at run time.
  const pp = (plan.mesh.dims.find((d) => d.name === p.dim) || { size: p.stages.length }).size;
  const perRank = p.virtual_stages > 1 && p.stages.length === pp;
  return section(`Pipeline: ${p.schedule}, ${p.stages.length} stages on ${p.dim}=${pp}, ${p.virtual_stages} per rank`,
    perRank ? el("p", { class: "muted" }, `Each row gives one ${p.dim} rank's layer count: applying the plan deals ` +
      `the layers out in model order over all ${pp * p.virtual_stages} virtual stages, stage s on rank s % ${pp}.`) : null,
    el("table", { id: "pipeline" },
      el("thead", {}, el("tr", {}, ["stage", `${p.dim} rank`, p.virtual_stages > 1 && !perRank ? "predicted time per virtual stage" : "predicted time",
        "modules"].map((h) => el("th", {}, h)))),
      el("tbody", {}, p.stages.map((s) => el("tr", {},
      el("td", {}, `stage ${s.index}`), el("td", { class: "num" }, perRank ? s.index : s.index % pp),
      el("td", { class: "num" }, fmtS(s.predicted_time_s)),
      el("td", { class: "mono" }, s.modules.length > 4 ? `${s.modules[0]} … ${s.modules[s.modules.length - 1]} (${s.modules.length})` : s.modules.join(", ")))))));
}

// json-formatter's togglers are links without an href: the mouse opens them, Tab never
// reaches them.  Each one (it renders children as they open) becomes a focusable button
// that Enter or Space toggles and that says whether it is open.
function keyboardTree(tree) {
  const mark = () => tree.querySelectorAll("a.json-formatter-toggler-link").forEach((a) => {
    a.tabIndex = 0;
    a.setAttribute("role", "button");
    a.setAttribute("aria-expanded", String(a.parentElement.classList.contains("json-formatter-open")));
  });
  new MutationObserver(mark).observe(tree, { childList: true, subtree: true, attributes: true, attributeFilter: ["class"] });
  tree.addEventListener("keydown", (ev) => {
    const a = ev.target.closest("a.json-formatter-toggler-link");
    if (a && (ev.key === "Enter" || ev.key === " ")) { ev.preventDefault(); a.click(); }
  });
  mark();
}

function rawSection(plan, name) {
  const download = el("button", { id: "download", onclick: () => {
    const url = URL.createObjectURL(new Blob([JSON.stringify(plan, null, 2)], { type: "application/json" }));
    const a = el("a", { href: url, download: name });
    document.body.append(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  } }, `Download ${name}`);
  const tree = el("div", { id: "json-tree" }, new JSONFormatter(plan, 1, { hoverPreviewEnabled: true }).render());
  keyboardTree(tree);
  return section("Raw plan", download, el("details", { open: "" }, el("summary", {}, "JSON tree (click to expand)"), tree));
}

function showPlan(main, plan, id) {
  document.title = `meshplan: ${plan.model} on ${plan.devices}`;
  main.replaceChildren(
    el("section", {}, el("h1", {}, `${plan.model} on ${plan.devices} devices (${plan.profile})`),
      el("div", { class: "facts" },
        [["plan", id || "local file"], ["batch", `${plan.batch_size} seq × ${plan.seq_len}`], ["micro-batches", plan.microbatches],
          ["checkpointing", plan.activation_checkpointing], ["schema", plan.schema_version], ["fingerprint", plan.fingerprint.digest]]
          .map(([k, v]) => el("span", {}, `${k} `, el("b", {}, v))))),
    meshSection(plan), placementSection(plan), memorySection(plan), timeSection(plan),
    ...[pipelineSection(plan), alternativesSection(plan), solverSection(plan), rawSection(plan, `plan-${id || "local"}.json`)]
      .filter(Boolean));
}

function showError(main, message) {
  main.replaceChildren(el("section", {}, el("h1", {}, "Nothing to show"),
    el("p", { class: "error", id: "error" }, message), el("p", {}, el("a", { href: "/" }, "all stored plans"))));
}

async function route() {
  const main = document.getElementById("main");
  // The server serves this page on / and /plans/{anything}: every /plans/ address is one
  // plan's page, and one whose id is not of an id's form names no plan, like an unknown id.
  const m = location.pathname.match(/^\/plans\/(.*?)\/?$/);
  try {
    if (!m) return await showList(main);
    let id = m[1];
    try { id = decodeURIComponent(id); } catch { /* keep it as written */ }
    if (!/^[0-9a-f]+$/.test(id)) throw new Error(`plan_id: no plan ${JSON.stringify(id)} (a plan id is hex digits)`);
    const res = await fetch(`/v1/plans/${id}`);
    const body = await res.json();
    if (!res.ok) throw new Error(body.detail || `GET /v1/plans/${id}: ${res.status}`);
    showPlan(main, body.plan, body.id);
  } catch (e) {
    showError(main, String(e.message || e));
  }
}

// A file opened from disk is a plan (`meshplan plan -o`, this page's download) or an
// answer of POST / GET /v1/plans ({"id", "plan"}); anything else gets a message naming
// what is missing (drawing it would fail on the first absent field, with the browser's
// "Cannot read properties of undefined").
const SCHEMA_VERSION = "1.0";
const PLAN_FIELDS = ["model", "profile", "devices", "batch_size", "seq_len", "mesh",
  "parameters", "prediction", "fingerprint", "solver"];

// The schema's defaults for what a valid plan may leave out (planner.schema), so that a
// file pydantic and the JSON Schema accept is drawn, as `meshplan show` shows it.
function withDefaults(plan) {
  const p = { modules: [], data_parallel: [], pipeline: null, microbatches: 1,
    activation_checkpointing: "none", ...plan };
  p.mesh = { device_type: "cuda", ...p.mesh };
  p.modules = p.modules.map((m) => ({ input: null, output: null, ...m }));
  if (p.pipeline) p.pipeline = { dim: "pp", virtual_stages: 1, ...p.pipeline };
  p.solver = { gap: null, unsupported_ops: {}, alternatives: [], notes: [], ...p.solver };
  p.solver.alternatives = p.solver.alternatives.map((a) => ({ peak_memory_bytes: null, note: "", ...a }));
  p.prediction = { ...p.prediction,
    time: { recompute_s: 0, resharding_s: 0, pipeline_bubble_s: 0, optimizer_s: 0, ...p.prediction.time },
    memory: { fsdp_gathered: 0, usable: null, ...p.prediction.memory } };
  return p;
}

// [plan with its defaults, the stored id of a {"id", "plan"} answer or undefined]
function planOfFile(data) {
  const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
  const answer = isObject(data) && isObject(data.plan);
  const plan = answer ? data.plan : data;
  if (!isObject(plan)) throw new Error("not a meshplan plan: the file holds no JSON object");
  const missing = PLAN_FIELDS.filter((k) => !(k in plan));
  if (missing.length) {
    throw new Error(`not a meshplan plan: no ${missing.map((k) => JSON.stringify(k)).join(", ")} ` +
      "(open a plan written by `meshplan plan -o` or downloaded from this page)");
  }
  if (plan.schema_version !== SCHEMA_VERSION) {  // required, as `meshplan show` requires it
    const given = "schema_version" in plan ? JSON.stringify(plan.schema_version) : "missing";
    throw new Error(`schema_version: ${given}; this viewer reads plans of ` +
      `schema ${SCHEMA_VERSION}`);
  }
  return [withDefaults(plan), answer ? data.id : undefined];
}

// Draws the plan in `text` (a file's contents), or an error naming the file.
function openPlanText(name, text) {
  const main = document.getElementById("main");
  try {
    const data = JSON.parse(text);
    const [plan, id] = planOfFile(data);
    showPlan(main, plan, id);
  } catch (e) {
    showError(main, `${name}: ${e.message}`);
  }
}

document.getElementById("open-file").addEventListener("change", async (ev) => {
  const file = ev.target.files[0];
  if (file) openPlanText(file.name, await file.text());
});

route();
