// The Otherix web console: plain JavaScript, no build step; one library,
// xterm.js for the terminal (vendored, loaded only when a terminal opens).
// Every page reads the /v1/ API with the session cookie (writes send the
// session's CSRF token too); the server decides what each caller may see
// and do. Text reaches the page through textContent only, never as HTML.
"use strict";

const PAGE_SIZE = 50;
const AUDIT_PAGE = 100;

let me = null;          // who is signed in (GET /ui/api/me)
let stream = null;      // the live EventSource
let current = null;     // the page shown: { topics, refresh, stop }

// ---------------------------------------------------------------- helpers

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function $(id) { return document.getElementById(id); }

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  if (method !== "GET") {
    headers["X-Otherix-CSRF"] = me ? me.csrf : "";
  }
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, {
    method, headers, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (resp.status === 204) return null;
  let data = null;
  try { data = await resp.json(); } catch (_) { data = null; }
  if (!resp.ok) {
    const err = data && data.error ? data.error : { code: "http_" + resp.status, message: resp.statusText };
    if (resp.status === 401 && path !== "/ui/api/session") signedOut(err.message);
    throw new ApiError(resp.status, err.code, err.message);
  }
  return data;
}

function qs(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const s = q.toString();
  return s ? "?" + s : "";
}

function isAdmin() { return me && me.role === "admin"; }

function when(t) {
  if (!t) return "—";
  const d = new Date(t);
  return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function ago(t) {
  if (!t) return "never";
  const s = Math.max(0, Math.round((Date.now() - new Date(t).getTime()) / 1000));
  return duration(s) + " ago";
}

function duration(s) {
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + (s % 60) + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h" + Math.floor((s % 3600) / 60) + "m";
  return Math.floor(s / 86400) + "d" + Math.floor((s % 86400) / 3600) + "h";
}

function since(t) {
  return duration(Math.max(0, Math.round((Date.now() - new Date(t).getTime()) / 1000)));
}

function labels(obj) {
  return Object.entries(obj || {}).map(([k, v]) => k + "=" + v).join(",");
}

function table(columns, rows, onRow) {
  const head = el("tr", {}, columns.map((c) => el("th", { text: c })));
  const body = rows.map((r) => {
    const tr = el("tr", { class: onRow ? "clickable" : null }, r.cells.map((c) => el("td", {}, c)));
    if (r.id) tr.dataset.id = r.id;
    if (onRow) tr.addEventListener("click", () => onRow(r));
    return tr;
  });
  return el("table", {}, el("thead", {}, head), el("tbody", {}, body));
}

function status(text) { return el("span", { class: String(text), text: String(text) }); }

function copyable(cmd) {
  const code = el("code", { class: "cmd", text: cmd });
  const btn = el("button", { type: "button", text: "Copy", onclick: () => navigator.clipboard && navigator.clipboard.writeText(cmd) });
  return el("div", { class: "copy" }, code, " ", btn);
}

function errorBox(e) {
  return el("p", { class: "error", role: "alert", text: e.message || String(e) });
}

function show(...nodes) {
  const page = $("page");
  page.replaceChildren(...nodes);
}

// ---------------------------------------------------------------- sign-in

function signedOut(message) {
  me = null;
  if (stream) { stream.close(); stream = null; }
  if (current && current.stop) current.stop();
  current = null;
  $("top").hidden = true;
  $("page").hidden = true;
  $("sign-in").hidden = false;
  $("sign-in-error").textContent = message || "";
}

async function signIn(ev) {
  ev.preventDefault();
  $("sign-in-error").textContent = "";
  let token = $("token").value.trim();
  const file = $("grant-file").files[0];
  if (!token && file) {
    const text = await file.text();
    const m = text.match(/^\s*token\s*=\s*"([^"]+)"/m);
    token = m ? m[1] : text.trim();
  }
  if (!token) { $("sign-in-error").textContent = "paste a token or choose a grant file"; return; }
  try {
    me = await api("POST", "/ui/api/session", { token });
    $("token").value = "";
    $("grant-file").value = "";
    started();
  } catch (e) {
    $("sign-in-error").textContent = e.message;
  }
}

async function signOut() {
  try { await api("DELETE", "/ui/api/session"); } catch (_) { /* signed out anyway */ }
  signedOut("signed out");
}

// ---------------------------------------------------------------- shell

const PAGES = [
  ["overview", "Overview"], ["vms", "VMs"], ["lbs", "Load balancers"], ["sessions", "Sessions"],
  ["audit", "Audit"], ["grants", "Grants"], ["nodes", "Nodes"],
];

function started() {
  $("sign-in").hidden = true;
  $("top").hidden = false;
  $("page").hidden = false;
  $("who").textContent = me.principal + (me.role ? " (" + me.role + ")" : "");
  const nav = $("nav");
  if (me.role) {
    nav.replaceChildren(...PAGES.map(([id, name]) => el("a", { href: "#/" + id, "data-page": id, text: name })));
  } else {
    nav.replaceChildren(el("a", { href: "#/access", "data-page": "access", text: "Your access" }));
  }
  connect();
  route();
}

function connect() {
  if (stream) stream.close();
  stream = new EventSource("/ui/api/events");
  stream.addEventListener("open", () => { $("live").className = "live on"; document.body.dataset.live = "on"; });
  stream.addEventListener("error", () => { $("live").className = "live off"; document.body.dataset.live = "off"; });
  stream.addEventListener("change", (ev) => {
    let topics = [];
    try { topics = JSON.parse(ev.data).topics || []; } catch (_) { topics = []; }
    if (current && current.topics.some((t) => topics.includes(t))) current.refresh();
  });
  stream.addEventListener("signed-out", (ev) => {
    let message = "signed out";
    try { message = JSON.parse(ev.data).message; } catch (_) { /* keep the default */ }
    signedOut(message);
  });
}

function route() {
  if (!me) return;
  const hash = location.hash.replace(/^#\/?/, "");
  const [name, ...rest] = hash.split("/");
  const arg = rest.length ? decodeURIComponent(rest.join("/")) : null;
  const pages = me.role
    ? { overview, vms: arg ? vmDetail : vms, lbs: arg ? lbDetail : lbs, sessions, audit, grants, nodes }
    : { access };
  const fallback = me.role ? "overview" : "access";
  const page = pages[name] ? name : fallback;
  if (!pages[name]) { history.replaceState(null, "", "#/" + fallback); }
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("current", a.dataset.page === page);
  if (current && current.stop) current.stop();
  delete document.body.dataset.loaded;
  document.body.dataset.page = page;
  current = pages[page](arg);
  current.refresh();
}

/** A page: what it shows is re-read by `load` when one of its topics changes.
 * A page draws into elements it made when it was opened: a load that ends
 * after another page was opened draws into elements no longer shown. */
function page(topics, load, stop) {
  let running = false, again = false;
  const handle = { topics, stop };
  handle.refresh = async () => {
    if (running) { again = true; return; }
    running = true;
    try {
      do { again = false; await load(); } while (again);
      // Said for whoever watches (the browser tests): this page has its data.
      if (current === handle) document.body.dataset.loaded = document.body.dataset.page;
    } catch (e) {
      if (e.status !== 401 && current === handle) show(errorBox(e));
    } finally {
      running = false;
    }
  };
  return handle;
}

// ---------------------------------------------------------------- overview

function overview() {
  const holder = el("div", { id: "overview" });
  show(el("h1", { text: "Overview" }), holder);
  return page(["nodes", "vms", "lbs", "sessions", "audit"], async () => {
    const o = await api("GET", "/ui/api/overview");
    const tile = (n, label, cls, id) => el("div", { class: "tile", id }, el("div", { class: "n " + (cls || ""), text: String(n) }), el("div", { class: "l", text: label }));
    const tiles = [
      tile(o.nodes_ready, "nodes Ready", "Ready", "t-nodes-ready"),
      tile(o.nodes_not_ready, "nodes NotReady", o.nodes_not_ready ? "NotReady" : "", "t-nodes-notready"),
      ...Object.entries(o.vms).map(([s, n]) => tile(n, "VMs " + s, s, "t-vms-" + s)),
      ...Object.entries(o.lbs).map(([s, n]) => tile(n, "load balancers " + s, s, "t-lbs-" + s)),
      tile(o.sessions_open, "sessions open", "", "t-sessions"),
    ];
    const refusals = me.role === "user" ? [] : [
      el("h2", { text: "Recent refusals" }),
      o.refusals.length === 0 ? el("p", { class: "muted", text: "None in the last 15 minutes." }) :
        table(["WHEN", "PRINCIPAL", "TARGET", "REASON"], o.refusals.map((r) => ({
          cells: [when(r.at), r.principal, (r.target || "—") + (r.port ? ":" + r.port : ""), r.reason || ""],
        }))),
    ];
    holder.replaceChildren(el("div", { class: "tiles" }, tiles), el("div", { class: "card" }, refusals));
  });
}

// ---------------------------------------------------------------- VMs

const vmFilter = { selector: "", state: "", after: [] };

function vms() {
  const selector = el("input", { id: "vm-selector", placeholder: "label selector, e.g. app=web", value: vmFilter.selector });
  const state = el("select", { id: "vm-state" }, ["", "pending", "running", "migrating", "failed"].map((s) => el("option", { value: s, text: s || "any state" })));
  state.value = vmFilter.state;
  const apply = (ev) => { ev.preventDefault(); vmFilter.selector = selector.value.trim(); vmFilter.state = state.value; vmFilter.after = []; current.refresh(); };
  const form = el("form", { class: "filters", onsubmit: apply }, selector, state, el("button", { type: "submit", text: "Filter" }));
  const holder = el("div", { id: "vm-table" });
  const pager = el("div", { class: "pager" });
  show(el("h1", { text: "VMs" }), form, holder, pager);
  return page(["vms"], async () => {
    const after = vmFilter.after[vmFilter.after.length - 1];
    let list;
    try {
      list = await api("GET", "/v1/vms" + qs({ limit: PAGE_SIZE + 1, selector: vmFilter.selector, state: vmFilter.state, after }));
    } catch (e) {
      if (e.status === 401) throw e;
      holder.replaceChildren(errorBox(e));
      return;
    }
    const more = list.length > PAGE_SIZE;
    const rows = list.slice(0, PAGE_SIZE);
    holder.replaceChildren(rows.length === 0 ? el("p", { class: "muted", text: "No VMs match." }) :
      table(["NAME", "STATE", "NODE", "IP", "NETWORK", "LABELS"], rows.map((v) => ({
        id: v.name, cells: [v.name, status(v.state), v.node || "—", v.ip, v.network, labels(v.labels)],
      })), (r) => { location.hash = "#/vms/" + encodeURIComponent(r.id); }));
    const prev = el("button", { type: "button", text: "‹ Previous", disabled: vmFilter.after.length === 0, onclick: () => { vmFilter.after.pop(); current.refresh(); } });
    const next = el("button", { type: "button", text: "Next ›", disabled: !more, onclick: () => { vmFilter.after.push(rows[rows.length - 1].name); current.refresh(); } });
    pager.replaceChildren(prev, next, el("span", { class: "muted", text: "page " + (vmFilter.after.length + 1) }));
  });
}

function vmDetail(name) {
  const holder = el("div", { id: "vm-detail" });
  // Outside what a refresh redraws: a change to the VM keeps the terminal.
  const terminal = terminalCard(name);
  show(el("p", {}, el("a", { href: "#/vms", text: "‹ VMs" })), holder, terminal.card);
  let accessAsked = false;
  return page(["vms"], async () => {
    const v = await api("GET", "/v1/vms/" + encodeURIComponent(name));
    const migration = v.migrate_to ? "to " + v.migrate_to + (v.migration_id ? " (" + v.migration_id + ")" : "") : "none";
    holder.replaceChildren(
      el("h1", { text: v.name }),
      el("div", { class: "card" }, el("dl", {},
        el("dt", { text: "state" }), el("dd", {}, status(v.state), v.reason ? " — " + v.reason : ""),
        el("dt", { text: "node" }), el("dd", { text: v.node || "not placed" }),
        el("dt", { text: "lease" }), el("dd", { text: v.ip + " (" + v.mac + ") on " + v.network }),
        el("dt", { text: "labels" }), el("dd", { text: labels(v.labels) || "none" }),
        el("dt", { text: "runtime" }), el("dd", { text: v.runtime + (v.accelerator ? " (" + v.accelerator + ")" : "") }),
        el("dt", { text: "migration" }), el("dd", { text: migration }),
        el("dt", { text: "id" }), el("dd", { text: v.id }),
        el("dt", { text: "created" }), el("dd", { text: when(v.created_at) }),
      )),
      el("div", { class: "card" }, el("h2", { text: "Connect" }),
        copyable("otherix ssh " + v.name),
        copyable("otherix forward " + v.name + " 8080:80"),
        copyable("otherix connect " + v.name + " 22"),
        v.runtime === "qemu" ? copyable("otherix console " + v.name) : null),
    );
    // The terminal is shown to those it opens for (a QEMU guest; an admin,
    // or a user whose rules list its console), as the server decides.
    if (!accessAsked && v.runtime === "qemu") {
      accessAsked = true;
      const a = await api("GET", "/ui/api/vms/" + encodeURIComponent(name) + "/console/access");
      terminal.card.hidden = !a.allowed;
    }
  }, terminal.stop);
}

// ---------------------------------------------------------------- the terminal

const XTERM = "/ui/vendor/xterm-5.5.0/";
/** The WebSocket subprotocol the console's terminal speaks; the session's
 * CSRF token rides as a second one (a browser's WebSocket sets no header). */
const TERM_PROTOCOL = "otherix.console.v1";
const TERM_CSRF_PREFIX = "otherix.csrf.";
let xtermLoading = null;

function loadScript(src) {
  return new Promise((resolve, reject) => {
    const s = el("script", { src });
    s.addEventListener("load", resolve);
    s.addEventListener("error", () => reject(new Error("cannot load " + src)));
    document.head.append(s);
  });
}

/** xterm.js and its fit addon, loaded once, on the first terminal. */
function loadXterm() {
  if (!xtermLoading) {
    stampStyleNonce();
    document.head.append(el("link", { rel: "stylesheet", href: XTERM + "xterm.css" }));
    xtermLoading = loadScript(XTERM + "xterm.js").then(() => loadScript(XTERM + "addon-fit.js"));
    xtermLoading.catch(() => { xtermLoading = null; });
  }
  return xtermLoading;
}

/** xterm.js's DOM renderer makes <style> elements of its own, which the
 * page's policy refuses unless they carry the nonce the page was served
 * with (its stylesheet link has it; see session::page_csp on the server).
 * So every <style> made by this page's script gets it, as it is made —
 * before it is inserted: a nonce set later does not count. Markup injected
 * into the page could not carry it (only script reads `.nonce`), and no
 * script but the console's own runs here (script-src 'self'). */
function stampStyleNonce() {
  const link = document.querySelector("link[rel=stylesheet][nonce]");
  const nonce = link ? link.nonce : "";
  if (!nonce || Object.prototype.hasOwnProperty.call(document, "createElement")) return;
  const create = Document.prototype.createElement;
  document.createElement = function (tag, options) {
    const e = create.call(this, tag, options);
    if (String(tag).toLowerCase() === "style") e.setAttribute("nonce", nonce);
    return e;
  };
}

/** The resumable stream (otherix_proto::resume), which the terminal offers
 * and the server grants unless resumes are off: a binary message is one
 * frame, a type byte and its body — Data (0) bytes, Ack (1) a big-endian
 * u64 of the units the sender received, End (2) a direction's end (one
 * unit). Each end keeps what it sent until the other acknowledges it, and
 * on a new connection sends again from what the other says it received.
 * What the server's 101 would say in headers (session, secret, grace, what
 * the guest's end received) comes in a first text message: a page cannot
 * read a WebSocket's headers. A resume offers the session, its secret and
 * what was received as subprotocols: never in the URL, which reaches logs. */
const RESUMABLE = "otherix.relay.resumable.v1";
const RESUME_PREFIX = "otherix.resume.";
const SECRET_PREFIX = "otherix.resume-secret.";
const RECEIVED_PREFIX = "otherix.received.";
const CAUSE_PREFIX = "otherix.cause.";
const T_DATA = 0, T_ACK = 1, T_END = 2;
/** Most typed bytes kept unacknowledged; keys beyond are dropped (and said). */
const KEEP_MAX = 1 << 20;
/** Largest data frame sent (the server takes 64 KiB). */
const FRAME_MAX = 16 * 1024;
/** Acknowledge once this much more reached xterm.js, or 100 ms after. */
const ACK_EVERY = 64 * 1024;

/** One session's side of the resumable stream: what was sent and is kept
 * until acknowledged, what was received and shown. `send(frame)` writes to
 * the connection carrying it now (none while it is away); `show(bytes,
 * done)` hands received bytes to xterm.js, `done` once they are drawn. */
function resumableStream(hello, send, show) {
  const s = { session: hello.session, secret: hello.secret, graceMs: hello.grace_ms,
    sent: 0, kept: [], received: 0, shown: 0, acked: 0, timer: null };
  const frame = (type, body) => {
    const f = new Uint8Array(1 + body.length);
    f[0] = type;
    f.set(body, 1);
    return f;
  };
  const ack = () => {
    clearTimeout(s.timer);
    s.timer = null;
    const f = new Uint8Array(9);
    f[0] = T_ACK;
    new DataView(f.buffer).setBigUint64(1, BigInt(s.shown));
    if (send(f)) s.acked = s.shown;
  };
  /** Typed bytes: kept, and sent if connected. False when too much waits. */
  s.write = (bytes) => {
    const keeping = s.kept.reduce((n, k) => n + k.data.length, 0);
    if (keeping + bytes.length > KEEP_MAX) return false;
    for (let i = 0; i < bytes.length; i += FRAME_MAX) {
      const data = bytes.subarray(i, i + FRAME_MAX);
      s.kept.push({ at: s.sent, data });
      s.sent += data.length;
      send(frame(T_DATA, data));
    }
    return true;
  };
  /** A binary message from the server. */
  s.receive = (msg) => {
    const type = msg[0], body = msg.subarray(1);
    if (type === T_DATA) {
      s.received += body.length;
      show(body, () => {
        s.shown += body.length;
        if (s.shown - s.acked >= ACK_EVERY) ack();
        else if (!s.timer) s.timer = setTimeout(ack, 100);
      });
    } else if (type === T_ACK && body.length === 8) {
      const n = Number(new DataView(body.buffer, body.byteOffset).getBigUint64(0));
      while (s.kept.length && s.kept[0].at + s.kept[0].data.length <= n) s.kept.shift();
    } else if (type === T_END) {
      s.received += 1; // the guest's side ended; the server's Close follows
    }
  };
  /** On a new connection: the guest's end received `n`; send the rest. */
  s.rewind = (n) => {
    for (const k of s.kept) {
      const skip = Math.max(0, n - k.at);
      if (skip < k.data.length) send(frame(T_DATA, k.data.subarray(skip)));
    }
    if (s.shown > s.acked) ack();
  };
  s.stop = () => clearTimeout(s.timer);
  return s;
}

/** A VM's serial console in xterm.js over the console's WebSocket
 * (/ui/api/vms/NAME/console): the guest's bytes one way, the keys typed
 * the other, as frames of the resumable stream (above) — so a lost
 * connection resumes where it was, the shell with it — or, from a server
 * with resumes off, as plain binary messages. The terminal fits its box; a
 * serial line carries no window size, so the guest keeps its own idea of
 * it (`stty cols N rows M` there). When the session ends the card says why. */
function terminalCard(name) {
  const state = el("span", { id: "term-state", class: "muted", text: "not connected" });
  const open = el("button", { id: "term-open", type: "button", class: "primary", text: "Open terminal" });
  const close = el("button", { id: "term-close", type: "button", text: "Disconnect", hidden: true });
  const screen = el("div", { id: "terminal" });
  const card = el("div", { class: "card", id: "term-card", hidden: true },
    el("h2", { text: "Serial console" }), el("div", { class: "filters" }, open, close, state), screen);
  const encoder = new TextEncoder();
  let term = null, fit = null, ws = null, observer = null;
  // The resumable session (null before its first message, or when the
  // server does not resume), whether `ws` carries it now, and the resume.
  let stream = null, live = false, lostAt = 0, attempt = 0, retry = null;

  const setState = (text, cls, phase) => {
    state.textContent = text;
    state.className = cls || "muted";
    card.dataset.phase = phase;
  };
  const sendFrame = (f) => {
    if (!live || ws.readyState !== WebSocket.OPEN) return false;
    ws.send(f);
    return true;
  };
  const send = (bytes) => {
    if (!bytes.length) return;
    if (stream) {
      if (!stream.write(bytes)) setState("input dropped: the guest has not taken what was typed before", "error", card.dataset.phase);
    } else if (ws && ws.readyState === WebSocket.OPEN && ws.protocol !== RESUMABLE) {
      ws.send(bytes); // (a resumable one takes keys once its first message came)
    }
  };
  const ended = (text, cls, phase) => {
    if (stream) stream.stop();
    stream = null;
    live = false;
    open.disabled = false;
    open.hidden = false;
    open.textContent = "Reconnect";
    close.hidden = true;
    setState(text, cls, phase);
  };
  // A handshake the server refused says nothing to a page (only that it
  // failed): ask the server whether the console opens for us, and why not.
  const refused = async () => {
    let why = "the console could not be opened (the guest's node may be unreachable); try again";
    try {
      const a = await api("GET", "/ui/api/vms/" + encodeURIComponent(name) + "/console/access");
      if (!a.allowed) why = a.reason;
    } catch (e) { why = e.message; }
    ended("refused: " + why, "error", "refused");
  };
  // A resume the server refused says nothing to a page either: before
  // trying again, ask whether the console still opens for us (signed out,
  // the rule gone, the VM deleted: the answer says so, and trying again
  // would only wait out the grace). A fetch that fails (the control plane
  // restarting) is no answer: the page goes on trying.
  const stillRefused = async () => {
    try {
      const a = await api("GET", "/ui/api/vms/" + encodeURIComponent(name) + "/console/access");
      return a.allowed ? null : a.reason;
    } catch (e) {
      return e instanceof ApiError ? e.message : null;
    }
  };
  // A lost connection (1006) or a control plane going away (4002): try
  // again with backoff and jitter while the session waits for us.
  const resume = (code) => {
    lostAt = lostAt || Date.now();
    if (Date.now() - lostAt > stream.graceMs) {
      ended("ended: not resumed within the grace period", "error", "ended");
      return;
    }
    attempt += 1;
    setState("connection lost, resuming (attempt " + attempt + ")…", "error", "resuming");
    const delay = Math.min(8000, 250 * 2 ** (attempt - 1)) * (0.5 + Math.random() / 2);
    retry = setTimeout(() => dial("connection-lost-" + code), delay);
  };
  const dial = (cause) => {
    const protocols = [TERM_PROTOCOL, TERM_CSRF_PREFIX + me.csrf, RESUMABLE];
    if (stream) {
      protocols.push(RESUME_PREFIX + stream.session, SECRET_PREFIX + stream.secret,
        RECEIVED_PREFIX + stream.received, CAUSE_PREFIX + cause);
    }
    const socket = new WebSocket("wss://" + location.host + "/ui/api/vms/" + encodeURIComponent(name) + "/console", protocols);
    socket.binaryType = "arraybuffer";
    ws = socket;
    let opened = false;
    const connected = (text) => {
      opened = true;
      live = true;
      setState(text, "healthy", "connected");
      open.hidden = true;
      close.hidden = false;
      term.focus();
    };
    socket.addEventListener("open", () => {
      // A resumable session is connected once the server said where it is.
      if (socket.protocol !== RESUMABLE) connected("connected");
    });
    socket.addEventListener("message", (ev) => {
      if (typeof ev.data === "string") {
        const hello = JSON.parse(ev.data);
        if (!stream) {
          stream = resumableStream(hello, sendFrame, (bytes, done) => term.write(bytes, done));
          connected("connected");
        } else {
          connected("resumed");
          stream.rewind(hello.received);
        }
        lostAt = 0;
        attempt = 0;
        return;
      }
      const msg = new Uint8Array(ev.data);
      if (stream) stream.receive(msg);
      // (Without resumes, an empty message: the guest's side ended.)
      else if (msg.length > 0) term.write(msg);
    });
    socket.addEventListener("close", (ev) => {
      if (ws !== socket) return;
      ws = null;
      live = false;
      if (stream && (ev.code === 1006 || ev.code === 4002)) {
        if (opened || attempt === 0) { resume(ev.code); return; }
        // A resume that did not open: refused, or nobody answered.
        stillRefused().then((why) => {
          if (why) ended("ended: " + why, "error", "ended");
          else resume(ev.code);
        });
        return;
      }
      if (!opened) { refused(); return; }
      const why = ev.reason || (ev.code === 1000 ? "closed" : "connection lost (code " + ev.code + ")");
      ended("ended: " + why, ev.code === 1000 ? "muted" : "error", "ended");
    });
  };
  const connect = async () => {
    open.disabled = true;
    setState("loading the terminal…", "muted", "loading");
    try {
      await loadXterm();
    } catch (e) {
      open.disabled = false;
      setState(e.message, "error", "failed");
      return;
    }
    if (!term) {
      // (Its theme reaches the rows through its own <style> element: the
      // browser tests check that the style nonce let it apply.)
      term = new Terminal({ cursorBlink: true, fontSize: 14, scrollback: 5000, theme: { foreground: "#e8e8e8", background: "#000000" } });
      fit = new FitAddon.FitAddon();
      term.loadAddon(fit);
      term.open(screen);
      term.onData((d) => send(encoder.encode(d)));
      term.onBinary((d) => send(Uint8Array.from(d, (c) => c.charCodeAt(0) & 0xff)));
      observer = new ResizeObserver(() => fit.fit());
      observer.observe(screen);
      window.otxTerminal = term; // read by the browser tests
    }
    fit.fit();
    setState("connecting…", "muted", "connecting");
    dial("");
  };
  open.addEventListener("click", connect);
  close.addEventListener("click", () => {
    clearTimeout(retry);
    if (ws && (live || !stream)) { ws.close(1000, "closed by the user"); return; }
    // Between resumes: nothing to tell (the session ends at its grace).
    if (ws) { const s = ws; ws = null; s.close(); }
    ended("ended: closed by the user", "muted", "ended");
  });
  const stop = () => {
    clearTimeout(retry);
    if (stream) stream.stop();
    stream = null;
    if (ws) { ws.close(1000, "page closed"); ws = null; }
    if (observer) observer.disconnect();
    if (term) term.dispose();
    if (window.otxTerminal === term) delete window.otxTerminal;
    term = null;
  };
  return { card, stop };
}

// ---------------------------------------------------------------- load balancers

function lbs() {
  const holder = el("div", { id: "lb-table" });
  show(el("h1", { text: "Load balancers" }), holder);
  return page(["lbs"], async () => {
    const list = await api("GET", "/v1/lbs");
    holder.replaceChildren(
      list.length === 0 ? el("p", { class: "muted", text: "No load balancers." }) :
        table(["NAME", "PORT", "SELECTOR", "STATUS", "TARGETS", "HEALTH CHECK"], list.map((lb) => ({
          id: lb.name,
          cells: [lb.name, String(lb.port), lb.selector, status(lb.status), lb.healthy + "/" + lb.total + " healthy",
            lb.health_check.kind + (lb.health_check.path ? ":" + lb.health_check.path : "")],
        })), (r) => { location.hash = "#/lbs/" + encodeURIComponent(r.id); }));
  });
}

function lbDetail(name) {
  const holder = el("div", { id: "lb-detail" });
  show(el("p", {}, el("a", { href: "#/lbs", text: "‹ Load balancers" })), holder);
  return page(["lbs"], async () => {
    const lb = await api("GET", "/v1/lbs/" + encodeURIComponent(name));
    holder.replaceChildren(
      el("h1", {}, lb.name + " ", status(lb.status)),
      el("p", { class: "muted", text: "port " + lb.port + ", selector " + lb.selector + ", " + lb.healthy + "/" + lb.total + " healthy" }),
      copyable("otherix forward lb/" + lb.name + " " + lb.port),
      table(["BACKEND", "NODE", "IP", "HEALTH", "ELIGIBLE", "LAST PROBE", "LAST CHANGE", "REASON"], (lb.backends || []).map((b) => ({
        id: b.vm,
        cells: [b.vm, b.node || "—", b.ip, status(b.health), b.eligible ? "yes" : "no",
          b.last_probe ? ago(b.last_probe) : "never", when(b.last_change), b.reason || ""],
      }))),
    );
  });
}

// ---------------------------------------------------------------- sessions

// 512 B, 1.5 KiB, 5.0 MiB: as `otherix session list` prints them.
function size(n) {
  const units = ["KiB", "MiB", "GiB", "TiB"];
  if (n < 1024) return n + " B";
  let v = n / 1024, u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
  return v.toFixed(1) + " " + units[u];
}

function sessions() {
  let list = [];
  const holder = el("div", { id: "session-table" });
  show(el("h1", { text: "Sessions open now" }), holder);
  const draw = () => {
    holder.replaceChildren(list.length === 0 ? el("p", { class: "muted", text: "No open sessions." }) :
      table(["PRINCIPAL", "TARGET", "TRANSPORT", "NODE", "STARTED", "DURATION", "UP", "DOWN", ""].filter((c) => c !== "" || isAdmin()), list.map((s) => ({
        id: s.id,
        cells: [s.principal, s.target + ":" + s.port, s.transport, s.node, when(s.started_at),
          el("span", { class: "duration", "data-started": s.started_at, text: since(s.started_at) }),
          // As last reported; the stream says when they moved (every 2 s at most).
          el("span", { class: "bytes-up", "data-bytes": String(s.bytes_up || 0), text: size(s.bytes_up || 0) }),
          el("span", { class: "bytes-down", "data-bytes": String(s.bytes_down || 0), text: size(s.bytes_down || 0) }),
          isAdmin() ? el("button", { type: "button", class: "danger end-session", text: "End", onclick: async (ev) => {
            ev.target.disabled = true;
            try { await api("POST", "/v1/sessions/" + encodeURIComponent(s.id) + "/end", {}); current.refresh(); }
            catch (e) { holder.prepend(errorBox(e)); }
          } }) : null].filter((c) => c !== null),
      }))));
  };
  // Durations tick here, in place; the list itself is re-read only when it changes.
  const timer = setInterval(() => {
    for (const d of holder.querySelectorAll(".duration")) d.textContent = since(d.dataset.started);
  }, 1000);
  return page(["sessions"], async () => { list = await api("GET", "/v1/sessions"); draw(); }, () => clearInterval(timer));
}

// ---------------------------------------------------------------- audit

const auditFilter = { principal: "", target: "", since: "86400", follow: true };

function audit() {
  const principal = el("input", { id: "audit-principal", placeholder: "principal (user:NAME)", value: auditFilter.principal });
  const target = el("input", { id: "audit-target", placeholder: "target", value: auditFilter.target });
  const since = el("select", { id: "audit-since" }, [["3600", "last hour"], ["86400", "last day"], ["604800", "last week"]].map(([v, t]) => el("option", { value: v, text: t })));
  since.value = auditFilter.since;
  const follow = el("input", { type: "checkbox", id: "audit-follow" });
  follow.checked = auditFilter.follow;
  follow.addEventListener("change", () => { auditFilter.follow = follow.checked; });
  let rows = [], next = null, cursors = [];
  const apply = (ev) => {
    ev.preventDefault();
    Object.assign(auditFilter, { principal: principal.value.trim(), target: target.value.trim(), since: since.value });
    cursors = []; rows = []; next = null; load(true);
  };
  const form = el("form", { class: "filters", onsubmit: apply }, principal, target, since, el("button", { type: "submit", text: "Filter" }),
    el("label", {}, follow, " follow live"));
  const holder = el("div", { id: "audit-table" });
  const pager = el("div", { class: "pager" });
  show(el("h1", { text: "Audit trail" }), form, holder, pager);
  const query = (after) => "/v1/audit" + qs({ principal: auditFilter.principal, target: auditFilter.target, since_seconds: auditFilter.since, limit: AUDIT_PAGE, after });
  const draw = () => {
    holder.replaceChildren(rows.length === 0 ? el("p", { class: "muted", text: "No events." }) :
      table(["WHEN", "PRINCIPAL", "ACTION", "TARGET", "ALLOWED", "REASON", "BYTES ↑/↓"], rows.map((r) => ({
        cells: [when(r.at), r.principal, r.action, (r.target || "—") + (r.port ? ":" + r.port : ""), r.allowed ? "yes" : status("refused"),
          r.reason || "", r.bytes_up !== undefined && r.bytes_up !== null ? r.bytes_up + "/" + r.bytes_down : ""],
      }))));
    const older = el("button", { type: "button", text: "‹ First page", disabled: cursors.length === 0, onclick: () => { cursors = []; load(true); } });
    const newer = el("button", { type: "button", text: "Next page ›", disabled: !next, onclick: () => { cursors.push(next); load(true); } });
    pager.replaceChildren(older, newer, el("span", { class: "muted", text: rows.length + " events shown" }));
  };
  // A page at a time from the cursor; following live, a page that reached
  // the end of the trail takes what came after its last record.
  const load = async (fresh) => {
    if (fresh) {
      const p = await api("GET", query(cursors[cursors.length - 1]));
      rows = p.events; next = p.next || null;
    } else if (auditFilter.follow && !next && rows.length < AUDIT_PAGE) {
      const last = rows[rows.length - 1];
      const after = last ? Math.floor(new Date(last.at).getTime()) + "." + last.id : cursors[cursors.length - 1];
      const p = await api("GET", query(after));
      rows = rows.concat(p.events.filter((e) => !last || e.id !== last.id));
      next = p.next || null;
      if (rows.length > AUDIT_PAGE) { next = after; }
    } else {
      return;
    }
    draw();
  };
  let first = true;
  return page(["audit"], async () => { await load(first); first = false; });
}

// ---------------------------------------------------------------- grants

function grants() {
  const made = el("div", { id: "grant-made" });
  const holder = el("div", { id: "grant-table" });
  const parts = [el("h1", { text: "Grants" })];
  if (isAdmin()) {
    const name = el("input", { id: "grant-name", placeholder: "name, e.g. acme-contractor", required: true });
    const targets = el("input", { id: "grant-targets", placeholder: "targets: web01:22, lb/web-lb:80", required: true });
    const ttl = el("select", { id: "grant-ttl" }, [["3600", "1 hour"], ["28800", "8 hours"], ["86400", "1 day"], ["604800", "1 week"]].map(([v, t]) => el("option", { value: v, text: t })));
    ttl.value = "28800";
    const max = el("input", { id: "grant-max", type: "number", min: "1", placeholder: "max connections (optional)" });
    const create = async (ev) => {
      ev.preventDefault();
      made.replaceChildren();
      try {
        const list = targets.value.split(",").map((t) => t.trim()).filter(Boolean).map((t) => {
          const i = t.lastIndexOf(":");
          if (i < 1) throw new Error("target " + t + ": expected VM:PORT or lb/NAME:PORT");
          return { target: t.slice(0, i), port: Number(t.slice(i + 1)) };
        });
        const body = { name: name.value.trim(), targets: list, ttl_seconds: Number(ttl.value) };
        if (max.value) body.max_connections = Number(max.value);
        const g = await api("POST", "/v1/grants", body);
        showGrantFile(made, g);
        name.value = ""; targets.value = ""; max.value = "";
        current.refresh();
      } catch (e) { made.replaceChildren(errorBox(e)); }
    };
    parts.push(el("form", { class: "card filters", id: "grant-form", onsubmit: create },
      el("strong", { text: "New grant" }), name, targets, ttl, max, el("button", { type: "submit", class: "primary", text: "Create" })));
  }
  parts.push(made, holder);
  show(...parts);
  return page(["grants"], async () => {
    let list;
    try { list = await api("GET", "/v1/grants"); } catch (e) {
      if (e.status === 401) throw e;
      holder.replaceChildren(errorBox(e)); return;
    }
    holder.replaceChildren(list.length === 0 ? el("p", { class: "muted", text: "No grants." }) :
      table(["NAME", "TARGETS", "STATE", "EXPIRES", "CONNECTIONS", "CREATED BY", ""].filter((c) => c !== "" || isAdmin()), list.map((g) => ({
        id: g.name,
        cells: [g.name, g.targets.map((t) => t.target + ":" + t.port).join(", "), status(g.state), when(g.expires_at),
          String(g.connections) + (g.max_connections ? "/" + g.max_connections : ""), g.created_by,
          isAdmin() ? (g.state === "active" ? el("button", { type: "button", class: "danger revoke-grant", text: "Revoke", onclick: async (ev) => {
            ev.target.disabled = true;
            try { await api("POST", "/v1/grants/" + encodeURIComponent(g.name) + "/revoke", {}); current.refresh(); }
            catch (e) { holder.prepend(errorBox(e)); }
          } }) : "") : null].filter((c) => c !== null),
      }))));
  });
}

/** The grant file `otherix login --grant-file` reads, for its holder. */
function grantFile(token) {
  const q = (s) => JSON.stringify(s);
  return "server = [" + q(location.origin) + "]\nca_fingerprint = " + q(me.ca_fingerprint) + "\ntoken = " + q(token) + "\n";
}

function showGrantFile(into, created) {
  const text = grantFile(created.token);
  const url = URL.createObjectURL(new Blob([text], { type: "application/toml" }));
  const file = created.grant.name + ".grant";
  into.replaceChildren(el("div", { class: "card" },
    el("h2", { text: "Grant " + created.grant.name + " created" }),
    el("p", { text: "Its token is shown only now. Hand the file to its holder, who runs:" }),
    copyable("otherix login --grant-file " + file),
    el("p", {}, el("a", { href: url, download: file, id: "grant-download", text: "Download " + file })),
    el("pre", { class: "secret", id: "grant-file-text", text: text })));
}

// ---------------------------------------------------------------- nodes

function nodes() {
  const made = el("div", { id: "join-made" });
  const holder = el("div", { id: "node-table" });
  const parts = [el("h1", { text: "Nodes" })];
  if (isAdmin()) {
    const name = el("input", { id: "join-node", placeholder: "node name", required: true });
    const hyper = el("input", { type: "checkbox", id: "join-hypervisor", checked: true });
    const gateway = el("input", { id: "join-gateway", placeholder: "gateway host:port (optional)" });
    const create = async (ev) => {
      ev.preventDefault();
      try {
        const body = { node: name.value.trim(), hypervisor: hyper.checked };
        if (gateway.value.trim()) body.gateway = gateway.value.trim();
        const t = await api("POST", "/v1/join-tokens", body);
        made.replaceChildren(el("div", { class: "card" }, el("p", { text: "Join token for " + t.node + " (shown once):" }),
          copyable("otherix agent --server " + location.origin + " --ca-fingerprint " + me.ca_fingerprint + " --join-token " + t.token)));
      } catch (e) { made.replaceChildren(errorBox(e)); }
    };
    parts.push(el("form", { class: "card filters", onsubmit: create }, el("strong", { text: "Join token" }), name,
      el("label", {}, hyper, " hypervisor"), gateway, el("button", { type: "submit", class: "primary", text: "Create join token" })));
  }
  parts.push(made, holder);
  show(...parts);
  return page(["nodes"], async () => {
    const [list, o] = await Promise.all([api("GET", "/v1/nodes"), api("GET", "/ui/api/overview")]);
    holder.replaceChildren(table(["NAME", "STATUS", "ROLES", "ADDRESS", "GUESTS", "LAST HEARTBEAT", "CERT EXPIRES", "AGENT"], list.map((n) => ({
      id: n.name,
      cells: [n.name, status(n.status), [n.roles.hypervisor ? "hypervisor" : null, n.roles.gateway ? "gateway " + n.roles.gateway : null, n.roles.relay ? "relay " + n.roles.relay : null].filter(Boolean).join(", ") || "—",
        n.vtep || "—", String(n.guests), ago(n.last_heartbeat), when(o.cert_expiry[n.name]), n.agent_version || "—"],
    }))));
  });
}

// ---------------------------------------------------------------- a grant holder's page

function access() {
  show(el("h1", { text: "Your access" }),
    el("p", { text: "Grant " + me.name + ", valid until " + when(me.expires_at) + ". It reaches:" }),
    table(["TARGET", "PORT", "COMMAND"], me.targets.map((t) => ({
      cells: [t.target, String(t.port), copyable("otherix forward " + t.target + " " + t.port)],
    }))),
    el("p", { class: "muted", text: "Log the CLI in with your grant file first: otherix login --grant-file FILE" }));
  return page([], async () => {});
}

// ---------------------------------------------------------------- start

document.addEventListener("DOMContentLoaded", async () => {
  $("sign-in-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  window.addEventListener("hashchange", route);
  try {
    me = await api("GET", "/ui/api/me");
    started();
  } catch (_) {
    signedOut("");
  }
});
