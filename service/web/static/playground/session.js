// The playground's session section: a session held by the server (POST sessions), stepped one
// token at a time. A step sends the token's q, k, v as (H, 1, d) with "at" the session's length
// and return_weights; the answer's weights (H, 1, S) are that token's row, kept under the earlier
// steps' rows, so each head's grid grows by a row and a column per token. Uses playground.js's
// helpers ($, mulberry32, normalMatrix, parseTensor, InputError, toNested, drawHeatmap).
"use strict";

const SESSION_SEED = 1;
const SESSION_MAX_TOKENS = 16; // a small session: the API's 413 past it is shown as it words it

const session = {id: null, heads: 2, d: 4, length: 0, rows: [], rand: null, busy: false, seq: 0};
// rows[i]: step i's weights, one array of i + 1 numbers per head.

class ApiError extends Error {
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.error = error;
  }
}

/** New random q, k, v for the next token in the three fields, (H, d) each, 2 decimals. */
function drawToken() {
  for (const name of ["q", "k", "v"]) {
    const m = normalMatrix(session.rand, session.heads, session.d, 1).map((row) => row.map((x) => Math.round(x * 100) / 100));
    $(`session-${name}`).value = JSON.stringify(session.heads === 1 ? m[0] : m).replaceAll(",", ", ");
  }
}

/** A field's token as (H, 1, d): one row per head, or one row for every head. */
function tokenTensor(name) {
  const value = parseTensor(`session-${name}`, name);
  if (!Array.isArray(value)) throw new InputError(`${name} must be a JSON array: d numbers, or one row of d per head.`);
  const perHead = Array.isArray(value[0]) ? value : Array.from({length: session.heads}, () => value);
  return perHead.map((row) => [row]);
}

function logLine(text) {
  const li = document.createElement("li");
  li.textContent = text;
  $("session-log").appendChild(li);
  while ($("session-log").children.length > 12) $("session-log").firstElementChild.remove();
}

/** Send method path (relative, as the rest of the page) with a JSON body; the answer's JSON (null
 * for 204), or an ApiError with the API's own error object. */
async function call(method, path, body) {
  const init = {method};
  if (body !== undefined) {
    init.headers = {"Content-Type": "application/json"};
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, {message: e.message}); // status 0: no answer
  }
  const text = await resp.text();
  let doc = null;
  try {
    doc = text ? JSON.parse(text) : null;
  } catch (e) {
    doc = {error: {message: text}};
  }
  logLine(`${method} ${path}: ${resp.status}${doc && doc.length !== undefined ? `, length ${doc.length}` : ""}`);
  if (!resp.ok) throw new ApiError(resp.status, (doc && doc.error) || {});
  return doc;
}

function drawSession() {
  const S = session.length;
  $("session-id").textContent = session.id || "none";
  $("session-length").textContent = String(S);
  const grids = [];
  for (let h = 0; S > 0 && h < session.heads; h++) {
    // Row t: the query of token t over keys 0..t, padded with the keys that came after it (masked).
    const matrix = session.rows.map((row) => Array.from({length: S}, (_, s) => (s < row[h].length ? row[h][s] : 0)));
    const wrap = document.createElement("div");
    wrap.className = "heatmap-wrap";
    wrap.dataset.head = String(h);
    wrap.appendChild(drawHeatmap(matrix, "top_left", null, `head ${h}: ${S} steps × ${S} keys`));
    grids.push(wrap);
  }
  $("session-heatmaps").replaceChildren(...grids);
  if (!grids.length) $("session-heatmaps").textContent = session.id ? "No tokens yet: step to append one." : "";
  const busy = session.busy;
  $("session-create").disabled = busy || session.id !== null;
  $("session-step").disabled = busy || session.id === null;
  $("session-drop").disabled = busy || session.id === null || S === 0;
  $("session-reset").disabled = busy || session.id === null;
  $("session-heads").disabled = $("session-dim").disabled = session.id !== null;
}

function sessionStatus(state, text) {
  if (state !== "loading") $("session-status").dataset.seq = String(++session.seq); // a settled action
  $("session-status").dataset.state = state;
  $("session-status").textContent = text;
}

/** Run one action (an async function returning its status text), the buttons off meanwhile. */
async function sessionAction(label, action) {
  if (session.busy) return;
  session.busy = true;
  drawSession();
  sessionStatus("loading", `${label} …`);
  try {
    const done = await action();
    $("session-error").hidden = true;
    sessionStatus("done", done);
  } catch (e) {
    const api = e instanceof ApiError && e.status > 0;
    if (!(e instanceof ApiError) && !(e instanceof InputError)) throw e;
    $("session-error").querySelector("strong").textContent = api ? "The API refused the request" : e instanceof InputError ? "Not sent" : "No answer from the service";
    $("session-error-code").textContent = api ? `${e.status} ${e.error.code || ""}` : "";
    $("session-error-message").textContent = e.message;
    $("session-error").hidden = false;
    sessionStatus("error", `${label}: failed`);
  } finally {
    session.busy = false;
    drawSession();
  }
}

function resetLocal() {
  Object.assign(session, {id: null, length: 0, rows: [], rand: mulberry32(SESSION_SEED)});
  session.heads = Number($("session-heads").value);
  session.d = Number($("session-dim").value);
  drawToken();
}

const create = () => sessionAction("Creating", async () => {
  const doc = await call("POST", "sessions", {heads: session.heads, head_dim: session.d, max_tokens: SESSION_MAX_TOKENS});
  Object.assign(session, {id: doc.id, length: doc.length, rows: []});
  return `Session created: ${doc.heads} heads of ${doc.head_dim}, at most ${doc.max_tokens} tokens.`;
});

const step = () => sessionAction("Stepping", async () => {
  const body = {q: tokenTensor("q"), k: tokenTensor("k"), v: tokenTensor("v"), at: session.length, return_weights: true};
  const doc = await call("POST", `sessions/${session.id}/attention`, body);
  session.rows.push(toNested(doc.weights).map((head) => head[0])); // (H, 1, S) -> one row per head
  session.length = doc.length;
  drawToken();
  return `Step ${doc.length}: the new token's query over ${doc.length} keys.`;
});

const drop = () => sessionAction("Truncating", async () => {
  const doc = await call("POST", `sessions/${session.id}/truncate`, {length: session.length - 1});
  session.length = doc.length;
  session.rows = session.rows.slice(0, doc.length);
  return `Truncated to ${doc.length} tokens.`;
});

const reset = () => sessionAction("Deleting", async () => {
  try {
    await call("DELETE", `sessions/${session.id}`);
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 404)) throw e; // expired already: gone all the same
  }
  resetLocal();
  return "Session deleted.";
});

document.addEventListener("DOMContentLoaded", () => {
  resetLocal();
  drawSession();
  $("session-heads").addEventListener("change", resetLocal);
  $("session-dim").addEventListener("change", resetLocal);
  $("session-create").addEventListener("click", create);
  $("session-drop").addEventListener("click", drop);
  $("session-reset").addEventListener("click", reset);
  $("session-controls").addEventListener("submit", (e) => {
    e.preventDefault();
    (session.id === null ? create : step)();
  });
  // Leaving the page deletes its session (it would expire when idle anyway).
  window.addEventListener("pagehide", () => session.id && fetch(`sessions/${session.id}`, {method: "DELETE", keepalive: true}));
});
