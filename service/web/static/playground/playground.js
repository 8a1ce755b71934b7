// The playground: builds a request from the chosen case, sends it to POST attention or POST mha
// (relative URLs), and draws what comes back: the weights as a heatmap per head, the output, the
// Server-Timing phases and the cost, or the API's error message as the API wrote it.
//
// Tensors are plain nested arrays here: a weights tensor of shape (..., T, S) is shown one
// (T, S) slice at a time, the leading axes (heads, batch) chosen with the head selector.
"use strict";

const $ = (id) => document.getElementById(id);

const WORKED = {q: [[1, 0], [0, 1], [1, 1]], k: [[1, 0], [0, 1], [1, 1]], v: [[1, 0], [0, 10], [5, 5]]};
const MHA_N = 6, MHA_D = 8;

const PRESETS = {
  worked: {causal: "top_left", note: "The worked example: q = k = [[1,0],[0,1],[1,1]], v = [[1,0],[0,10],[5,5]]. Query 0 sees only key 0; query 2 sees all three."},
  lookup: {causal: "false", note: "Each query is one of the keys, scaled by s. Move the slider: the weights sharpen from uniform to one-hot."},
  mha: {causal: "top_left", note: "A random causal multi-head case: x Wq, x Wk, x Wv split into heads. Pick a head to see its weights."},
  custom: {causal: "top_left", note: "Edit q, k, v; the request is sent when a field loses focus, or with the button."},
};

// --- a seeded normal generator, so a seed always draws the same random case -------------------

function mulberry32(seed) {
  let a = seed >>> 0;
  return function () {
    a = (a + 0x6D2B79F5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function normalMatrix(rand, rows, cols, std) {
  // Box-Muller; values rounded to 4 decimals so the request body stays readable.
  const m = [];
  for (let i = 0; i < rows; i++) {
    const row = [];
    for (let j = 0; j < cols; j++) {
      const u = 1 - rand(), v = rand();
      const z = Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
      row.push(Math.round(z * std * 1e4) / 1e4);
    }
    m.push(row);
  }
  return m;
}

function scaledEye(n, s) {
  return Array.from({length: n}, (_, i) => Array.from({length: n}, (_, j) => (i === j ? s : 0)));
}

// --- the request -----------------------------------------------------------------------------

class InputError extends Error {}

function causalValue() {
  const c = $("causal").value;
  return c === "false" ? false : c;
}

/** [left, right] of the sliding-window control, or null when it is off. Sent as typed (even -2):
 * the API's own message says what is wrong with a window, so the page does not second-guess it. */
function windowValue() {
  if (!$("window-on").checked) return null;
  return ["left", "right"].map((side) => {
    const text = $(`window-${side}`).value.trim();
    if (!text) throw new InputError(`window ${side} is empty: type an integer, -1 for no limit.`);
    return Number(text);
  });
}

/** The divisors of n, ascending: the key/value head counts that /mha takes for n heads. */
function divisors(n) {
  return Array.from({length: n}, (_, i) => i + 1).filter((d) => n % d === 0);
}

function parseTensor(id, name) {
  const text = $(id).value.trim();
  if (!text) throw new InputError(`${name} is empty: paste a JSON array such as [[1, 0], [0, 1]].`);
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new InputError(`${name} is not valid JSON (${e.message}).`);
  }
}

/** {path, body, kind} for the current controls; kind is "attention" or "mha". */
function buildRequest() {
  const preset = $("preset").value;
  const causal = causalValue();
  let req;
  if (preset === "worked") {
    req = {path: "attention", body: {...WORKED, causal}};
  } else if (preset === "lookup") {
    const keys = scaledEye(8, Number($("sharpness").value));
    req = {path: "attention", body: {q: keys, k: keys, v: keys, causal, scale: 1}};
  } else if (preset === "mha") {
    const heads = Number($("heads").value), kvHeads = Number($("kv-heads").value);
    const kvWidth = (MHA_D / heads) * kvHeads; // kv_heads heads of width d / heads (Llama's layout)
    const rand = mulberry32(Number($("seed").value) || 0);
    const x = normalMatrix(rand, MHA_N, MHA_D, 1);
    const [wq, wk, wv, wo] = [MHA_D, kvWidth, kvWidth, MHA_D].map((cols) => normalMatrix(rand, MHA_D, cols, 0.5));
    // /mha is self-attention (T = S): both alignments are the same mask, and it takes a boolean.
    req = {path: "mha", body: {x, wq, wk, wv, wo, heads, kv_heads: kvHeads, causal: causal !== false}};
  } else {
    const body = {q: parseTensor("custom-q", "q"), k: parseTensor("custom-k", "k"), v: parseTensor("custom-v", "v"), causal};
    const scale = $("custom-scale").value.trim();
    if (scale) {
      const s = Number(scale);
      if (!Number.isFinite(s)) throw new InputError(`scale must be a number, not ${JSON.stringify(scale)}.`);
      body.scale = s;
    }
    req = {path: "attention", body};
  }
  const win = windowValue(); // every preset takes it: /attention and /mha alike
  if (win) req.body.window = win;
  req.kind = req.path;
  return req;
}

// --- reading tensors from a response (nested, flat or b64, as the request was encoded) ---------

function shapeOf(nested) {
  const shape = [];
  for (let a = nested; Array.isArray(a); a = a[0]) shape.push(a.length);
  return shape;
}

function toNested(tensor) {
  if (Array.isArray(tensor)) return tensor;
  let data = tensor.data;
  if (tensor.b64 !== undefined) {
    const bytes = Uint8Array.from(atob(tensor.b64), (c) => c.charCodeAt(0));
    data = Array.from(new (tensor.dtype === "float64" ? Float64Array : Float32Array)(bytes.buffer));
  }
  const build = (shape, offset) => {
    if (shape.length === 1) return data.slice(offset, offset + shape[0]);
    const step = shape.slice(1).reduce((a, b) => a * b, 1);
    return Array.from({length: shape[0]}, (_, i) => build(shape.slice(1), offset + i * step));
  };
  return build(tensor.shape, 0);
}

/** The (rows, cols) matrices of a tensor (..., rows, cols), in row-major order of the leading axes. */
function slices(nested) {
  const out = [];
  const walk = (a, depth) => (depth === 2 ? out.push(a) : a.forEach((b) => walk(b, depth - 1)));
  walk(nested, shapeOf(nested).length);
  return out;
}

// --- drawing ---------------------------------------------------------------------------------

const state = {seq: 0, result: null};

function fmt(x, digits = 4) {
  if (x === 0) return "0";
  const a = Math.abs(x);
  return a >= 1e-3 && a < 1e5 ? String(Number(x.toPrecision(digits))) : x.toExponential(digits - 1);
}

/** Whether cell (t, s) of a T x S weights matrix is masked by the causal setting and the window
 * [left, right] (or null) the page sent. The window is bottom-right aligned (FlashAttention's
 * window_size): t + S - T - left <= s <= t + S - T + right, -1 leaving a side open; ANDed with causal. */
function maskedCell(causal, win, t, s, T, S) {
  if (win) {
    const [left, right] = win, diag = t + S - T;
    if (left >= 0 && s < diag - left) return true;
    if (right >= 0 && s > diag + right) return true;
  }
  if (causal === false) return false;
  if (causal === "bottom_right") return s > t + S - T;
  return s > t; // true or "top_left"
}

function cellColour(w) {
  // One hue, lightness falling from 97% (weight 0) to 17% (weight 1): monotone in greyscale too.
  const light = 97 - 80 * Math.min(1, Math.max(0, w));
  return {bg: `hsl(215 70% ${light}%)`, fg: light < 55 ? "#fff" : "#1b1f24"};
}

function describe(cell) {
  const t = cell.dataset.row, s = cell.dataset.col;
  return cell.dataset.masked === "true"
    ? `query ${t}, key ${s}: masked (weight 0)`
    : `query ${t}, key ${s}: weight ${fmt(Number(cell.dataset.weight), 6)}`;
}

// A header cell of a table: scope "col" or "row", its text, and a tooltip if given.
function headerCell(scope, text, title) {
  const th = document.createElement("th");
  th.scope = scope;
  th.textContent = text;
  if (title) th.title = title;
  return th;
}

function drawHeatmap(matrix, causal, win, caption) {
  const T = matrix.length, S = matrix[0].length;
  const table = document.createElement("table");
  table.className = "heatmap" + (S > 12 ? " dense" : "");
  table.setAttribute("role", "grid");
  table.setAttribute("aria-readonly", "true");
  table.createCaption().textContent = caption;
  const head = table.createTHead().insertRow();
  head.appendChild(Object.assign(document.createElement("td"), {className: "corner"}));
  for (let s = 0; s < S; s++) {
    head.appendChild(headerCell("col", `k${s}`, `key ${s}`));
  }
  const body = table.createTBody();
  matrix.forEach((row, t) => {
    const tr = body.insertRow();
    tr.appendChild(headerCell("row", `q${t}`, `query ${t}`));
    row.forEach((w, s) => {
      const td = tr.insertCell();
      const masked = maskedCell(causal, win, t, s, T, S);
      td.dataset.weight = String(w);
      td.dataset.row = t;
      td.dataset.col = s;
      td.dataset.masked = String(masked);
      td.tabIndex = t === 0 && s === 0 ? 0 : -1; // one tab stop; arrow keys move inside the grid
      if (masked) {
        td.className = "masked";
        td.textContent = "×";
      } else {
        const {bg, fg} = cellColour(w);
        td.style.background = bg;
        td.style.color = fg;
        td.textContent = w.toFixed(2);
      }
      td.title = describe(td);
      td.setAttribute("aria-label", td.title);
    });
  });
  table.addEventListener("keydown", gridKeys);
  table.addEventListener("focusin", (e) => e.target.dataset.weight !== undefined && readout(e.target));
  table.addEventListener("mouseover", (e) => e.target.dataset.weight !== undefined && readout(e.target));
  return table;
}

function readout(cell) {
  cell.closest("section").querySelector(".readout").textContent = describe(cell); // the grid's own section
}

function gridKeys(e) {
  const cell = e.target;
  if (cell.dataset.weight === undefined) return;
  const rows = e.currentTarget.tBodies[0].rows;
  let t = Number(cell.dataset.row), s = Number(cell.dataset.col);
  const T = rows.length, S = rows[0].cells.length - 1;
  const moves = {ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1]};
  if (e.key in moves) {
    t = Math.min(T - 1, Math.max(0, t + moves[e.key][0]));
    s = Math.min(S - 1, Math.max(0, s + moves[e.key][1]));
  } else if (e.key === "Home") s = 0;
  else if (e.key === "End") s = S - 1;
  else return;
  e.preventDefault();
  const next = rows[t].cells[s + 1];
  cell.tabIndex = -1;
  next.tabIndex = 0;
  next.focus();
}

function drawValues(matrix) {
  const table = document.createElement("table");
  table.className = "values";
  const head = table.createTHead().insertRow();
  head.appendChild(document.createElement("td"));
  matrix[0].forEach((_, j) => {
    head.appendChild(headerCell("col", j));
  });
  const body = table.createTBody();
  matrix.forEach((row, t) => {
    const tr = body.insertRow();
    tr.appendChild(headerCell("row", `q${t}`));
    row.forEach((x) => (tr.insertCell().textContent = fmt(x)));
  });
  const wrap = document.createElement("div");
  wrap.className = "values-wrap";
  wrap.appendChild(table);
  return wrap;
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    tr.appendChild(headerCell("row", k));
    tr.insertCell().textContent = v;
    return tr;
  }));
}

/** Server-Timing: "decode;dur=0.4, validate;dur=0.1" -> [["decode", "0.4"], ...]. */
function serverTiming(header) {
  if (!header) return [];
  return header.split(",").map((part) => {
    const [name, ...params] = part.trim().split(";");
    const dur = params.map((p) => p.trim()).find((p) => p.startsWith("dur="));
    return [name, dur ? dur.slice(4) : ""];
  });
}

/** Label of slice i of a weights tensor with these leading axes. */
function sliceLabel(kind, leading, i) {
  const index = [];
  for (let r = leading.length - 1, rest = i; r >= 0; r--) {
    index.unshift(rest % leading[r]);
    rest = Math.floor(rest / leading[r]);
  }
  if (kind === "mha") return leading.length === 1 ? `head ${index[0]}` : `batch ${index[0]}, head ${index[1]}`;
  return `index [${index.join(", ")}]`;
}

function drawResult() {
  const {req, body, timing} = state.result;
  const weights = toNested(body.weights);
  const shape = shapeOf(weights);
  const leading = shape.slice(0, -2);
  const mats = slices(weights);
  const select = $("head");
  const chosen = Math.min(Number(select.value) || 0, mats.length - 1);
  if (select.options.length !== mats.length || select.dataset.kind !== req.kind) {
    select.replaceChildren(...mats.map((_, i) => new Option(sliceLabel(req.kind, leading, i), i)));
    select.dataset.kind = req.kind;
  }
  select.value = String(chosen);
  $("head-row").hidden = mats.length === 1;
  $("head-row").querySelector("label").textContent = req.kind === "mha" ? "Head" : "Slice";

  const causal = req.kind === "mha" ? (req.body.causal ? "top_left" : false) : req.body.causal;
  const win = req.body.window || null;
  const [T, S] = shape.slice(-2);
  for (const side of ["left", "right"]) $(`window-${side}`).max = String(Math.max(T, S));
  const which = mats.length > 1 ? ` of ${sliceLabel(req.kind, leading, chosen)}` : "";
  $("heatmap-title").textContent = `Weights${which}`;
  const windowNote = win ? `; window [${win.join(", ")}]` : "";
  $("heatmap").replaceChildren(drawHeatmap(mats[chosen], causal, win,
    `${T} queries × ${S} keys of weights (${shape.join(", ")}); causal mask: ${causal === false ? "off" : causal.replace("_", "-")}${windowNote}`));

  $("thumbs").replaceChildren(...(mats.length > 1 ? mats.map((m, i) => {
    const thumb = document.createElement("div");
    thumb.className = "thumb" + (i === chosen ? " selected" : "");
    thumb.style.gridTemplateColumns = `repeat(${m[0].length}, 6px)`;
    m.forEach((row, t) => row.forEach((w, s) => {
      const span = document.createElement("span");
      span.style.background = maskedCell(causal, win, t, s, m.length, row.length) ? "#fff" : cellColour(w).bg;
      thumb.appendChild(span);
    }));
    thumb.addEventListener("click", () => { select.value = String(i); drawResult(); });
    return thumb;
  }) : []));

  // The output slice that goes with this weights slice: /attention's out has the same leading
  // axes; /mha's out has no head axis, so the batch index only.
  const out = slices(toNested(body.out));
  const outIndex = req.kind === "mha" ? Math.floor(chosen / leading[leading.length - 1]) : chosen;
  $("out-shape").textContent = `(${shapeOf(toNested(body.out)).join(", ")})`;
  $("outputs").replaceChildren(drawValues(out[Math.min(outIndex, out.length - 1)]));

  fillRows($("timing").tBodies[0], serverTiming(timing));
  fillRows($("cost").tBodies[0], [
    ["flops", body.cost.flops.toLocaleString("en")],
    ["score elements", body.cost.score_elements.toLocaleString("en")],
    ["predicted ms", fmt(body.cost.predicted_ms, 3)],
  ]);
}

function showError(title, code, message) {
  $("error").querySelector("strong").textContent = title;
  $("error-code").textContent = code;
  $("error-message").textContent = message;
  $("error").hidden = false;
  $("result").hidden = true;
}

function setStatus(stateName, text) {
  // data-seq names the request whose outcome is shown, data-sent the latest one: equal, the page has settled.
  if (stateName !== "loading") $("status").dataset.seq = String(state.seq);
  $("status").dataset.state = stateName;
  $("status").textContent = text;
}

// --- sending ---------------------------------------------------------------------------------

async function run() {
  const seq = ++state.seq; // only the latest request's answer is drawn
  $("status").dataset.sent = String(seq);
  let req;
  try {
    req = buildRequest();
  } catch (e) {
    if (!(e instanceof InputError)) throw e;
    showError("The page did not send the request", "", e.message);
    setStatus("error", "Not sent: fix the input.");
    return;
  }
  $("request-path").textContent = `POST ${req.path}`;
  $("request-body").textContent = JSON.stringify(req.body);
  setStatus("loading", `Sending POST ${req.path} …`);
  let resp, body;
  try {
    resp = await fetch(req.path, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(req.body)});
    body = await resp.json();
  } catch (e) {
    if (seq !== state.seq) return;
    showError("No answer from the service", "", `${e.message}`);
    setStatus("error", "The request failed.");
    return;
  }
  if (seq !== state.seq) return;
  if (!resp.ok) {
    const err = body.error || {};
    const where = err.field ? `, field ${err.field}` : "";
    showError("The API refused the request", `${resp.status} ${err.code || ""}${where}`, err.message || JSON.stringify(body));
    setStatus("error", `POST ${req.path}: ${resp.status}`);
    return;
  }
  state.result = {req, body, timing: resp.headers.get("Server-Timing")};
  $("error").hidden = true;
  $("result").hidden = false;
  drawResult();
  setStatus("done", `POST ${req.path}: ${resp.status}, request ${state.seq}`);
}

let timer = null;
function runSoon() {
  // The slider fires on every step: wait for a short pause, then send once.
  clearTimeout(timer);
  timer = setTimeout(run, 120);
}

function fitKvHeads() {
  // The key/value head choices are the divisors of heads; keep the choice if it still divides.
  const heads = Number($("heads").value), select = $("kv-heads");
  const kept = heads % Number(select.value) === 0 ? select.value : String(heads);
  select.replaceChildren(...divisors(heads).map((d) => new Option(String(d), String(d))));
  select.value = kept;
}

function applyPreset() {
  const name = $("preset").value;
  const preset = PRESETS[name];
  for (const panel of ["lookup", "mha", "custom"]) $(`panel-${panel}`).hidden = panel !== name;
  $("causal").value = preset.causal;
  $("preset-note").textContent = preset.note;
  $("head").value = "0";
  run();
}

document.addEventListener("DOMContentLoaded", () => {
  $("preset").addEventListener("change", applyPreset);
  $("sharpness").addEventListener("input", () => {
    $("sharpness-value").textContent = $("sharpness").value;
    runSoon();
  });
  $("heads").addEventListener("change", fitKvHeads);
  $("window-on").addEventListener("change", () => {
    for (const side of ["left", "right"]) $(`window-${side}`).disabled = !$("window-on").checked;
    run();
  });
  for (const id of ["seed", "heads", "kv-heads", "window-left", "window-right", "causal", "custom-q", "custom-k", "custom-v", "custom-scale"]) {
    $(id).addEventListener("change", run);
  }
  $("head").addEventListener("change", drawResult);
  $("controls").addEventListener("submit", (e) => { e.preventDefault(); run(); });
  applyPreset();
});
