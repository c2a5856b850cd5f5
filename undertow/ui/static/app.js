// Undertow run viewer: a hash-routed page over the JSON of undertow/ui/server.py.
// Routes: #/ runs · #/compare/A,B · #/run/R · #/run/R/step/N · #/run/R/tree/G ·
// #/run/R/session/G/S?offset=K · #/live. Plain DOM, no library, nothing fetched elsewhere;
// numbers and colours are format.js's.
"use strict";

const CHARTS = [
  ["reward (mean ± spread)", "reward_mean", "reward_std"], ["pass rate", "pass_rate"],
  ["loss", "loss"], ["KL (behaviour ‖ policy)", "kl"], ["entropy", "entropy"],
  ["staleness (mean)", "staleness_mean"], ["tokens / s (trained)", "tokens_per_s"],
  ["groups dropped", "groups_dropped"],
  ["groups trained with one reward (no signal)", "num_uniform_groups"],
  ["sessions re-run", "num_rerun_sessions"],
  ["train/sample mismatch (mean |Δ logprob|)", "mismatch_mean"],
  ["tokens sampled ≥ 1 version behind", "version_behind_fraction"],
  ["tokens masked by the version gap", "version_masked_fraction"],
];
const STEPS_PER_PAGE = 50;
const GROUPS_PER_PAGE = 50;
const CALLS_PER_PAGE = 10;
let liveSource = null;

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

function svg(tag, attrs, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value);
  }
  for (const child of children.flat()) if (child) el.append(child);
  return el;
}

async function getJSON(url) {
  const reply = await fetch(url);
  const text = await reply.text();
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    throw new Error(`${url}: HTTP ${reply.status}, not JSON: ${text.slice(0, 300)}`);
  }
  if (!reply.ok) throw new Error(body.error || `${url}: HTTP ${reply.status}`);
  return body;
}

const enc = encodeURIComponent;

function show(...nodes) {
  const view = document.getElementById("view");
  view.replaceChildren(...nodes.flat(2).filter(n => n !== null && n !== undefined));
}

function crumbs(...parts) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(...parts.flatMap((p, i) => [i ? " / " : "",
    p[1] ? h("a", { href: p[1] }, p[0]) : h("span", {}, p[0])]));
}

function problems(list) {
  if (!list || !list.length) return null;
  return h("div", { class: "problems", "data-testid": "problems" },
    h("strong", {}, "Missing or unreadable:"), h("ul", {}, list.map(p => h("li", {}, p))));
}

// ---- charts ----

function derive(records) {
  return records.map(r => ({ ...r, groups_dropped: dropped(r),
    version_behind_fraction: typeof r.version_gap0_fraction === "number"
      ? 1 - r.version_gap0_fraction : undefined }));
}

function lineChart(title, series) {
  const W = 340, H = 170, L = 58, B = 20, T = 8, R = 8;
  const points = series.flatMap(s => s.points.flatMap(p => s.band
    ? [[p[0], p[1] - (p[2] || 0)], [p[0], p[1] + (p[2] || 0)]] : [p]));
  const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-chart": title });
  if (!points.length) {
    box.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6b7280" }));
    box.lastChild.textContent = "not recorded";
  } else {
    const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const pad = Math.abs(y0) / 10 || 1; y0 -= pad; y1 += pad; }
    const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = y => H - B - (y - y0) / (y1 - y0) * (H - B - T);
    box.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#9ca3af" }),
               svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#9ca3af" }));
    const ticks = [y1, (y0 + y1) / 2, y0];
    axisLabels(ticks).forEach((text, i) => {
      const y = sy(ticks[i]);
      if (i === 1) box.append(svg("line", { x1: L, y1: y, x2: W - R, y2: y, stroke: "#e5e7eb" }));
      const label = svg("text", { x: L - 4, y: y + 3, "text-anchor": "end", "font-size": 10,
                                  fill: "#6b7280", "data-axis": "y" });
      label.textContent = text;
      box.append(label);
    });
    for (const [text, x, anchor] of [[`step ${x0}`, L, "start"], [String(x1), W - R, "end"]]) {
      const label = svg("text", { x, y: H - 4, "text-anchor": anchor, "font-size": 10,
                                  fill: "#6b7280" });
      label.textContent = text;
      box.append(label);
    }
    for (const s of series) {
      if (s.band) {
        const upper = s.points.map(p => `${sx(p[0])},${sy(p[1] + (p[2] || 0))}`);
        const lower = s.points.slice().reverse().map(p => `${sx(p[0])},${sy(p[1] - (p[2] || 0))}`);
        box.append(svg("polygon", { points: upper.concat(lower).join(" "), fill: s.color,
                                    "fill-opacity": 0.15 }));
      }
      box.append(svg("polyline", { points: s.points.map(p => `${sx(p[0])},${sy(p[1])}`).join(" "),
                                   fill: "none", stroke: s.color, "stroke-width": 1.8 }));
      for (const p of s.points) {
        const dot = svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: s.color });
        const tip = svg("title");
        tip.textContent = `${s.name} · step ${p[0]}: ${sig(p[1], 4)}`;
        dot.append(tip);
        box.append(dot);
      }
    }
  }
  return h("div", { class: "chart" }, h("h3", {}, title), box);
}

function chartGrid(runs) {
  const colours = palette(runs.length);
  const legend = h("div", { class: "legend" }, runs.map((run, i) => h("span", {},
    h("span", { class: "swatch", style: `background:${colours[i]}` }), run.name)));
  const charts = CHARTS.map(([title, key, spread]) => lineChart(title, runs.map((run, i) => ({
    name: run.name, color: colours[i], band: Boolean(spread),
    points: derive(run.metrics).filter(r => typeof r[key] === "number")
      .map(r => [r.step, r[key], spread ? r[spread] : 0]),
  }))));
  return [legend, h("div", { class: "charts", "data-testid": "charts" }, charts)];
}

// ---- pages ----

async function runsPage() {
  crumbs(["runs"]);
  const data = await getJSON("/api/runs");
  const checked = new Set();
  const compare = h("button", { onclick: () => {
    location.hash = `#/compare/${[...checked].map(enc).join(",")}`; }, disabled: true },
    "overlay selected runs");
  const rows = data.runs.map(run => h("tr", { "data-run": run.name },
    h("td", {}, h("input", { type: "checkbox", "aria-label": `select ${run.name}`, onchange: e => {
      e.target.checked ? checked.add(run.name) : checked.delete(run.name);
      compare.disabled = checked.size < 2; } })),
    h("td", {}, h("a", { href: `#/run/${enc(run.name)}` }, run.name)),
    h("td", {}, run.status), h("td", { class: "num" }, run.num_steps),
    h("td", { class: "num" }, run.num_groups),
    h("td", {}, run.problems.length ? run.problems.join("; ") : "")));
  show(h("h1", {}, "Runs"), problems(data.problems),
       h("table", { "data-testid": "runs" }, h("tr", {}, ["", "run", "status", "steps", "groups",
         "not there"].map(t => h("th", {}, t))), rows), compare);
}

async function comparePage(names) {
  crumbs(["runs", "#/"], ["overlay"]);
  const runs = await Promise.all(names.map(n => getJSON(`/api/runs/${enc(n)}`)));
  show(h("h1", {}, `Overlay: ${names.join(" · ")}`), ...chartGrid(runs));
}

function paged(items, perPage, render, label) {
  const box = h("div", { "data-testid": `${label}-pages` });
  const draw = page => {
    const pages = Math.max(1, Math.ceil(items.length / perPage));
    const slice = items.slice(page * perPage, (page + 1) * perPage);
    box.replaceChildren(render(slice), pages > 1 ? h("div", { class: "pager" },
      h("button", { disabled: page === 0, onclick: () => draw(page - 1) }, "previous"),
      `${label} page ${page + 1} of ${pages}`,
      h("button", { disabled: page + 1 >= pages, onclick: () => draw(page + 1) }, "next"))
      : "");
  };
  draw(0);
  return box;
}

const ROLE_COLOURS = { rollout: "#93c5fd", training: "#fca5a5", switching: "#fde68a" };

function cellTimeline(events) {
  // One row per cell; each segment is the cell's role from one recorded event to the next.
  if (!events.length) return null;
  const cells = Object.keys(events[0].cells).sort((a, b) => Number(a) - Number(b));
  const t0 = events[0].t_s, t1 = Math.max(events[events.length - 1].t_s, t0 + 1);
  const W = 900, L = 60, ROW = 22, H = cells.length * ROW + 30;
  const sx = t => L + (t - t0) / (t1 - t0) * (W - L - 10);
  const box = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-testid": "cells" });
  cells.forEach((cell, row) => {
    const label = svg("text", { x: 4, y: row * ROW + 15, "font-size": 11 });
    label.textContent = `cell ${cell}`;
    box.append(label);
    events.forEach((event, i) => {
      const end = i + 1 < events.length ? events[i + 1].t_s : t1;
      const role = event.cells[cell] || "?";
      const rect = svg("rect", { x: sx(event.t_s), y: row * ROW + 3, height: ROW - 6,
        width: Math.max(0.5, sx(end) - sx(event.t_s)), fill: ROLE_COLOURS[role] || "#d1d5db",
        "data-role": role });
      const tip = svg("title");
      tip.textContent = `cell ${cell}: ${role} from ${event.t_s}s (${event.event})`;
      rect.append(tip);
      box.append(rect);
    });
  });
  for (const event of events.filter(e => e.event === "published")) {
    box.append(svg("line", { x1: sx(event.t_s), x2: sx(event.t_s), y1: 0, y2: H - 24,
      stroke: "#111827", "stroke-dasharray": "3 2" }));
    const nearEnd = sx(event.t_s) > W - 40;
    const label = svg("text", { x: sx(event.t_s) + (nearEnd ? -2 : 2), y: H - 12, "font-size": 10,
      "text-anchor": nearEnd ? "end" : "start" });
    label.textContent = `v${event.weight_version ?? event.step}`;
    box.append(label);
  }
  const axis = svg("text", { x: W - 10, y: H - 2, "text-anchor": "end", "font-size": 10,
    fill: "#6b7280" });
  axis.textContent = `${(t1 - t0).toFixed(1)} s`;
  box.append(axis);
  const roles = [...new Set(events.flatMap(e => Object.values(e.cells)))];
  return [h("h2", {}, "Cells over time"), h("div", { class: "legend" }, roles.map(role =>
    h("span", {}, h("span", { class: "swatch", style: `background:${ROLE_COLOURS[role] || "#d1d5db"}` }),
      role)), h("span", {}, "dashed: a weight version published")),
    h("div", { class: "tree-wrap" }, box)];
}

async function runPage(name) {
  crumbs(["runs", "#/"], [name]);
  const run = await getJSON(`/api/runs/${enc(name)}`);
  const stepTable = slice => h("table", { "data-testid": "steps" },
    h("tr", {}, ["step", "reward", "pass rate", "loss", "kl", "entropy", "sessions", "dropped",
      "step s"].map(t => h("th", {}, t))),
    derive(slice).map(r => h("tr", {}, h("td", {}, h("a", { href: `#/run/${enc(name)}/step/${r.step}` },
      `step ${r.step}`)), [r.reward_mean, r.pass_rate, r.loss, r.kl, r.entropy, r.num_sessions,
      r.groups_dropped, r.step_s].map(v => h("td", { class: "num" }, fmt(v))))));
  const groupList = slice => h("ul", { "data-testid": "groups" }, slice.map(g => h("li", {},
    h("a", { href: `#/run/${enc(name)}/tree/${enc(g)}` }, g))));
  show(h("h1", {}, `Run ${name}`), h("p", { class: "muted" }, `${run.path} · ${run.status}`),
       problems(run.problems), ...chartGrid([run]), cellTimeline(run.cell_timeline),
       h("h2", {}, `Steps (${run.metrics.length})`),
       run.metrics.length ? paged(run.metrics, STEPS_PER_PAGE, stepTable, "steps")
         : h("p", { class: "muted" }, "no step recorded"),
       h("h2", {}, `Groups in the store (${run.groups.length})`),
       paged(run.groups, GROUPS_PER_PAGE, groupList, "groups"),
       h("h2", {}, "Config"), h("pre", { "data-testid": "config" },
         Object.keys(run.config).length ? JSON.stringify(run.config, null, 2)
           : "no config (no readable checkpoint)"));
}

async function stepPage(name, step) {
  crumbs(["runs", "#/"], [name, `#/run/${enc(name)}`], [`step ${step}`]);
  const data = await getJSON(`/api/runs/${enc(name)}/steps/${step}`);
  const groups = data.groups.map(group => h("section", { "data-group": group.group },
    h("h2", {}, `Group ${group.group} `, h("a", { href: `#/run/${enc(name)}/tree/${enc(group.group)}` },
      "tree")),
    h("table", { "data-testid": "sessions" }, h("tr", {}, ["session", "reward", "advantage", "cause",
      "duration s", "calls", "new prompt tokens", "sampled tokens"].map(t => h("th", {}, t))),
    group.sessions.map(s => h("tr", {}, h("td", {}, h("a", {
      href: `#/run/${enc(name)}/session/${enc(group.group)}/${enc(s.session)}` }, s.session)),
      h("td", { class: "num" }, fmt(s.reward)), h("td", { class: "num", "data-testid": "advantage" },
        fmt(s.advantage, 4)), h("td", {}, s.cause), h("td", { class: "num" }, fmt(s.duration_s, 2)),
      [s.num_calls, s.num_new_prompt_tokens, s.num_completion_tokens].map(v =>
        h("td", { class: "num" }, fmt(v))))))));
  const metrics = Object.entries(data.metrics).filter(([, v]) => typeof v !== "object");
  show(h("h1", {}, `Step ${step} of ${name}`),
       h("p", { class: "muted" }, (data.groups_source === "recorded" ? "groups as the learner recorded them"
         : "groups inferred from launch order (this run did not record them)") +
         (dropped(data.metrics) ? `; ${dropped(data.metrics)} of those the step took were dropped ` +
           "(stale, uniform rewards or invalid), not trained" : "")),
       problems(data.missing_groups.map(g => `group ${g} is not in the store`)),
       groups.length ? groups : h("p", { class: "muted" }, "no group of this step is in the store"),
       h("h2", {}, "Metrics"), h("table", {}, metrics.map(([k, v]) =>
         h("tr", {}, h("th", {}, k), h("td", { class: "num" }, fmt(v, 5))))));
}

const dropped = r => (r.num_dropped_groups || 0) + (r.num_dropped_uniform || 0) +
  (r.num_dropped_invalid || 0);

function tokenColor(logprob) {
  if (logprob === null || logprob === undefined) return "transparent";
  const p = Math.exp(logprob);  // 1: white, 0: red
  return `hsl(0, 85%, ${Math.round(55 + 45 * p)}%)`;
}

function replyNode(reply) {
  // One span per sampled token; one pair of listeners on the box (not per token), so a
  // page of thousands of tokens draws fast. The tooltip text is built on hover.
  const box = h("div", { class: "reply", "data-testid": "reply" });
  const tip = document.getElementById("tip");
  const spans = reply.pieces.map((piece, i) => {
    const span = document.createElement("span");
    span.className = "tok";
    span.dataset.i = i;
    span.style.background = tokenColor(reply.logprobs[i]);
    span.textContent = piece;
    return span;
  });
  box.append(...spans);
  box.addEventListener("mouseover", e => {
    const i = e.target.dataset ? e.target.dataset.i : undefined;
    if (i === undefined) return;
    const lp = reply.logprobs[i];
    tip.textContent = `token ${JSON.stringify(reply.pieces[i])} · id ${reply.token_ids[i]} · ` +
      `logprob ${lp === null ? "–" : lp.toFixed(4)} · weight v${reply.weight_versions[i]}`;
    tip.hidden = false;
    tip.style.left = `${e.clientX + 12}px`;
    tip.style.top = `${e.clientY + 14}px`;
  });
  box.addEventListener("mouseleave", () => { tip.hidden = true; });
  return box;
}

function promptNode(text) {
  // Tool calls and their results are laid out apart from the rest of the text.
  const parts = text.split(/(<tool_call>[\s\S]*?<\/tool_call>|<tool_response>[\s\S]*?<\/tool_response>)/);
  return h("pre", { "data-testid": "prompt" }, parts.map(part =>
    /^<tool_(call|response)>/.test(part) ? h("div", { class: "toolcall" }, part) : part));
}

function callNode(call) {
  const reply = replyNode(call.reply);
  const replyText = call.reply.pieces.join("");
  const tools = [...replyText.matchAll(/<tool_call>([\s\S]*?)<\/tool_call>/g)].map(m => m[1]);
  return h("div", { class: "call", "data-call": call.index },
    h("h3", {}, `Call ${call.index + 1}`, call.labels.map(l => h("span", { class: "label" }, l)),
      h("span", { class: "muted" }, ` · ${call.num_prompt_tokens} prompt tokens ` +
        `(${call.num_new_prompt_tokens} new) · ${call.reply.token_ids.length} sampled · ` +
        `finish ${call.finish_reason ? JSON.stringify(call.finish_reason) : "–"}`)),
    h("details", { open: call.index === 0 }, h("summary", {}, "messages sent (new in this call)"),
      promptNode(call.prompt_text)),
    h("div", {}, "reply (shaded by probability: white = sure, red = unlikely)"), reply,
    tools.length ? h("div", {}, h("strong", {}, "tool calls"),
      tools.map(t => h("pre", { class: "toolcall" }, t.trim()))) : null);
}

function diffNode(diff) {
  return h("pre", { "data-testid": "diff" }, diff.split("\n").map(line => h("div", {
    class: line.startsWith("+") ? "diff-add" : line.startsWith("-") ? "diff-del" : null }, line)));
}

async function sessionPage(name, group, session, offset) {
  crumbs(["runs", "#/"], [name, `#/run/${enc(name)}`], [group, `#/run/${enc(name)}/tree/${enc(group)}`],
         [session]);
  const data = await getJSON(`/api/runs/${enc(name)}/groups/${enc(group)}/sessions/` +
    `${enc(session)}?offset=${offset}&limit=${CALLS_PER_PAGE}`);
  const base = `#/run/${enc(name)}/session/${enc(group)}/${enc(session)}`;
  const pages = Math.max(1, Math.ceil(data.num_calls / CALLS_PER_PAGE));
  const pager = h("div", { class: "pager" },
    h("button", { disabled: offset === 0, onclick: () => {
      location.hash = `${base}?offset=${Math.max(0, offset - CALLS_PER_PAGE)}`; } }, "previous calls"),
    `calls ${offset + 1}–${Math.min(offset + CALLS_PER_PAGE, data.num_calls)} of ${data.num_calls}` +
      ` (page ${Math.floor(offset / CALLS_PER_PAGE) + 1} of ${pages})`,
    h("button", { disabled: offset + CALLS_PER_PAGE >= data.num_calls, onclick: () => {
      location.hash = `${base}?offset=${offset + CALLS_PER_PAGE}`; } }, "next calls"));
  const outcome = Object.entries(data.outcome).filter(([k]) => k !== "tests");
  const tests = Object.entries(data.outcome.tests || {});
  show(h("h1", {}, `Session ${session}`),
       h("table", { "data-testid": "outcome" }, h("tr", {}, h("th", {}, "reward"),
         h("td", {}, fmt(data.reward))), h("tr", {}, h("th", {}, "closed"), h("td", {}, data.closed)),
         outcome.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, fmt(v))))),
       data.decoded ? null : problems(["no tokenizer in the run: token IDs are shown instead of text"]),
       h("h2", {}, "Test verdicts"), tests.length ? h("table", { "data-testid": "tests" },
         tests.map(([t, v]) => h("tr", {}, h("td", {}, t), h("td", {}, v))))
         : h("p", { class: "muted" }, "no test verdicts recorded"),
       h("h2", {}, "Final diff"), data.diff ? diffNode(data.diff)
         : h("p", { class: "muted" }, "no diff recorded"),
       data.scaffold_messages.length ? [h("h2", {}, "Messages as the scaffold kept them"),
         h("details", {}, h("summary", {}, `${data.scaffold_messages.length} messages ` +
           "(the scaffold's trajectory file)"), h("div", { "data-testid": "scaffold-messages" },
           data.scaffold_messages.map(m => h("div", { class: "call" }, h("strong", {}, m.role),
             promptNode(m.content)))))] : null,
       h("h2", {}, "Calls"), pager, h("div", { "data-testid": "calls" }, data.calls.map(callNode)));
}

function treeLayout(nodes) {
  const byParent = new Map();
  for (const n of nodes) {
    if (!byParent.has(n.parent)) byParent.set(n.parent, []);
    byParent.get(n.parent).push(n);
  }
  const placed = [];
  let row = 0;
  const visit = (node, depth) => {
    const kids = byParent.get(node.id) || [];
    const first = row;
    if (!kids.length) row += 1;
    for (const kid of kids) visit(kid, depth + 1);
    placed.push({ node, depth, y: (first + row - 1) / 2 });
  };
  for (const root of byParent.get(0) || []) visit(root, 0);
  return { placed, rows: row };
}

async function treePage(name, group) {
  crumbs(["runs", "#/"], [name, `#/run/${enc(name)}`], [`tree ${group}`]);
  const data = await getJSON(`/api/runs/${enc(name)}/groups/${enc(group)}/tree`);
  const sessions = Object.keys(data.sessions);
  const colours = palette(sessions.length);
  const colour = sid => colours[sessions.indexOf(sid)];
  const { placed, rows } = treeLayout(data.nodes);
  const maxTokens = Math.max(1, ...data.nodes.map(n => n.num_tokens));
  const COL = 170, ROW = 34, MAXW = 150;
  const width = (n) => 8 + (MAXW - 8) * Math.sqrt(n.num_tokens / maxTokens);
  const depth = Math.max(0, ...placed.map(p => p.depth)) + 1;
  const box = svg("svg", { width: depth * COL + 20, height: rows * ROW + 20, "data-testid": "tree" });
  const pos = new Map(placed.map(p => [p.node.id, p]));
  for (const p of placed) {
    const parent = pos.get(p.node.parent);
    if (parent) box.append(svg("line", { x1: 10 + parent.depth * COL + width(parent.node),
      y1: 10 + parent.y * ROW + 10, x2: 10 + p.depth * COL, y2: 10 + p.y * ROW + 10, stroke: "#9ca3af" }));
  }
  for (const p of placed) {
    const n = p.node, owner = n.sampled_by;
    const target = owner || n.sessions[0];
    const fill = owner ? colour(owner) : "#e5e7eb";
    const rect = svg("rect", { x: 10 + p.depth * COL, y: 10 + p.y * ROW, width: width(n), height: 20,
      rx: 3, fill, "data-node": n.id, "data-session": target || "",
      onclick: () => { if (target) location.hash = `#/run/${enc(name)}/session/${enc(group)}/${enc(target)}`; } });
    const tip = svg("title");
    tip.textContent = `node ${n.id} · ${n.num_tokens} tokens · ` +
      (owner ? `sampled by ${owner}` : `prompt, shared by ${n.sessions.length} session(s)`) +
      `\n${n.preview}`;
    rect.append(tip);
    const label = svg("text", { x: 14 + p.depth * COL, y: 10 + p.y * ROW + 14 });
    label.textContent = `${n.num_tokens} tok${owner ? "" : ` · ${n.sessions.length}×`}`;
    box.append(rect, label);
  }
  const legend = h("div", { class: "legend" }, h("span", {}, h("span", { class: "swatch",
    style: "background:#e5e7eb" }), "prompt (shared prefix: n× = sessions through it)"),
    sessions.map(sid => h("span", {}, h("span", { class: "swatch", style: `background:${colour(sid)}` }),
      h("a", { href: `#/run/${enc(name)}/session/${enc(group)}/${enc(sid)}` }, sid),
      ` reward ${fmt(data.sessions[sid].reward)}`)));
  show(h("h1", {}, `Tree of group ${group}`), h("p", { class: "muted" },
    `${data.nodes.length} nodes · ${data.num_unique_tokens} unique tokens · width by tokens, ` +
    "colour by the session that sampled them; click a node to open its session"),
    legend, h("div", { class: "tree-wrap" }, box));
}

async function livePage() {
  crumbs(["runs", "#/"], ["live"]);
  const info = await getJSON("/api/info");
  if (!info.live) {
    show(h("h1", {}, "Live"), problems(["live view is off: start undertow ui with --gateway URL " +
      "(admin token in UNDERTOW_ADMIN_TOKEN)"]));
    return;
  }
  const status = h("p", { class: "muted", "data-testid": "live-status" }, "connecting…");
  const body = h("tbody");
  show(h("h1", {}, `Live: open sessions at ${info.gateway}`), status,
       h("table", { "data-testid": "live" }, h("tr", {}, ["session", "group", "calls so far"]
         .map(t => h("th", {}, t))), body));
  liveSource = new EventSource("/api/live");
  liveSource.addEventListener("sessions", e => {
    const event = JSON.parse(e.data);
    status.textContent = event.error || `${event.sessions.length} open · ${new Date().toLocaleTimeString()}`;
    body.replaceChildren(...event.sessions.map(s => h("tr", { "data-live-session": s.session_id },
      h("td", {}, s.session_id), h("td", {}, s.group), h("td", { class: "num" }, s.num_calls))));
  });
}

async function route() {
  if (liveSource) { liveSource.close(); liveSource = null; }
  document.getElementById("tip").hidden = true;
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(query || "");
  try {
    if (!parts.length) await runsPage();
    else if (parts[0] === "live") await livePage();
    else if (parts[0] === "compare") await comparePage(parts.slice(1).join("/").split(","));
    else if (parts[0] === "run" && parts.length === 2) await runPage(parts[1]);
    else if (parts[0] === "run" && parts[2] === "step") await stepPage(parts[1], Number(parts[3]));
    else if (parts[0] === "run" && parts[2] === "tree") await treePage(parts[1], parts[3]);
    else if (parts[0] === "run" && parts[2] === "session") {
      await sessionPage(parts[1], parts[3], parts[4], Number(params.get("offset") || 0));
    } else show(h("p", { class: "error" }, `no page ${location.hash}`));
  } catch (error) {
    show(h("p", { class: "error", "data-testid": "error" }, error.message));
  }
  document.body.dataset.ready = location.hash || "#/";
}

window.addEventListener("hashchange", route);
getJSON("/api/info").then(info => { document.getElementById("live-link").hidden = !info.live; })
  .catch(() => {});
route();
