// The page at /: plain JavaScript, no library, nothing loaded from elsewhere. It talks to the same
// API as any LibreTranslate client: /frontend/settings, /languages, /translate; and our /glossaries,
// with the terms a glossary or the translation memory decided marked, and /jobs for files.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "nmt.apiKey";
const MAX_RETRIES = 3; // automatic retries of a 429/503, each after the server's Retry-After

const state = {
  settings: { charLimit: 5000, frontendTimeout: 500, keyRequired: false, supportedFilesFormat: [] },
  languages: [], // [{code, name, targets}] from /languages
  maxAlternatives: 2,
  key: localStorage.getItem(KEY_STORAGE) || "",
  timer: null, // the debounce of translate-as-you-type
  controller: null, // aborts the translation in flight when a newer one starts
  sequence: 0,
  detected: null, // the language detected for the current text (source "auto")
  retryTimer: null,
  extensions: [], // the file extensions the server translates (".txt"), lower case
  jobs: new Map(), // this session's document jobs: id -> {job, view, timer, failures}
  translation: "", // the text shown in #output
  glossaries: [], // the stored ones, from GET /glossaries
};

class ApiError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

// --- talking to the server ---------------------------------------------------------------------

// Every request carries the key (where the page has one) in the X-API-Key header: checked before
// the server reads the body, and never in a URL, where it would reach logs and the history.
async function call(path, options = {}) {
  const headers = new Headers(options.headers || {});
  try {
    if (state.key) headers.set("X-API-Key", state.key);
  } catch (_) {
    throw new ApiError(403, "the key holds characters that cannot be sent (a header takes Latin-1 only)");
  }
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "Cannot reach the server. Check the connection, then retry.");
  }
  if (response.ok) return response;
  let message = `The server answered ${response.status}.`;
  try {
    const body = await response.json();
    if (body && typeof body.error === "string") message = body.error;
  } catch (_) {
    /* not JSON: keep the status line */
  }
  const retryAfter = Number.parseFloat(response.headers.get("Retry-After") || "");
  throw new ApiError(response.status, message, Number.isFinite(retryAfter) ? retryAfter : null);
}

async function getJson(path) {
  return (await call(path)).json();
}

// --- messages ----------------------------------------------------------------------------------

function clearMessage() {
  clearTimeout(state.retryTimer);
  $("message").hidden = true;
  $("message").className = "";
  $("retry").hidden = true;
}

function showMessage(text, { kind = "error", retry = null } = {}) {
  $("message-text").textContent = text;
  $("message").className = kind;
  $("message").hidden = false;
  $("retry").hidden = !retry;
  $("retry").onclick = retry
    ? () => {
        clearMessage();
        retry(0);
      }
    : null;
}

// What a person should read for each failure; busy answers are retried by themselves.
function explain(err, what) {
  switch (err.status) {
    case 0:
      return err.message;
    case 403:
      // Without keys, a 403 is another refusal (stored glossaries not shared): no key would help.
      if (!state.settings.keyRequired && !state.key) return err.message;
      showKeyPanel(state.key ? "The API key was not accepted. Check it and save it again." : null);
      return `This server needs a valid API key: ${err.message}`;
    case 408:
      return "The upload took too long. Try again, or with a smaller file.";
    case 413:
      return `Too large: ${err.message}. ${what === "file" ? "Choose a smaller file." : "Shorten the text."}`;
    case 429:
    case 503:
      return `The server is busy (${err.status}): ${err.message}`;
    case 504:
      return `The translation took too long and was stopped. Try a shorter ${what}.`;
    default:
      return err.status >= 500 ? `The server failed (${err.status}): ${err.message}` : err.message;
  }
}

function handleError(err, what, retry, attempt) {
  if (err.name === "AbortError") return;
  const text = explain(err, what);
  const busy = err.status === 429 || err.status === 503;
  if (busy && attempt < MAX_RETRIES) {
    let seconds = Math.max(1, Math.ceil(err.retryAfter || 1));
    const tick = () => {
      showMessage(`${text}. Retrying in ${seconds} s…`, { kind: "busy", retry });
      if (seconds-- <= 0) {
        clearMessage();
        retry(attempt + 1);
        return;
      }
      state.retryTimer = setTimeout(tick, 1000);
    };
    tick();
    return;
  }
  showMessage(text, { retry: busy || err.status === 0 || err.status === 504 ? retry : null });
}

// --- languages ---------------------------------------------------------------------------------

function nameOf(code) {
  const found = state.languages.find((l) => l.code === code);
  return found ? found.name : code;
}

function sources() {
  return state.languages.filter((l) => l.targets.length > 0);
}

function targetsOf(source) {
  if (source === "auto") return [...new Set(sources().flatMap((l) => l.targets))];
  const found = state.languages.find((l) => l.code === source);
  return found ? found.targets : [];
}

function fillSelect(select, options, wanted) {
  select.replaceChildren(
    ...options.map(({ code, name }) => {
      const option = document.createElement("option");
      option.value = code;
      option.textContent = name;
      return option;
    }),
  );
  const codes = options.map((o) => o.code);
  select.value = codes.includes(wanted) ? wanted : codes[0] || "";
}

function fillTargets(wanted) {
  fillSelect(
    $("target"),
    targetsOf($("source").value).map((code) => ({ code, name: nameOf(code) })),
    wanted,
  );
  updateSwap();
}

function effectiveSource() {
  const source = $("source").value;
  return source === "auto" ? state.detected : source;
}

function updateSwap() {
  const from = effectiveSource();
  const to = $("target").value;
  const possible = Boolean(from) && targetsOf(to).includes(from);
  $("swap").disabled = !possible;
  $("swap").title = possible
    ? "Swap languages"
    : from
      ? `${nameOf(to)} → ${nameOf(from)} is not available on this server`
      : "Swap languages (once the language is detected)";
}

function swap() {
  const from = effectiveSource();
  const to = $("target").value;
  if (!from || !targetsOf(to).includes(from)) return;
  $("source").value = to;
  fillTargets(from);
  fillGlossaries();
  if (state.translation) $("input").value = state.translation;
  showTranslation("");
  state.detected = null;
  updateCounter();
  translateNow();
}

// --- text --------------------------------------------------------------------------------------

function updateCounter() {
  const length = $("input").value.length;
  const limit = state.settings.charLimit;
  $("counter").textContent = limit > 0 ? `${length} / ${limit}` : `${length}`;
  $("counter").classList.toggle("over", limit > 0 && length > limit);
  return limit <= 0 || length <= limit;
}

function showDetected() {
  const text = $("detected");
  text.textContent =
    $("source").value === "auto" && state.detected
      ? `Detected: ${nameOf(state.detected)}${state.confidence != null ? ` (${Math.round(state.confidence)}%)` : ""}`
      : "";
}

function hideAlternatives() {
  $("alternatives").hidden = true;
  $("more").setAttribute("aria-expanded", "false");
}

function scheduleTranslate() {
  clearTimeout(state.timer);
  hideAlternatives();
  state.timer = setTimeout(() => translateNow(), state.settings.frontendTimeout);
}

async function translateNow(attempt = 0, alternatives = 0) {
  clearTimeout(state.timer);
  const text = $("input").value;
  if (state.controller) state.controller.abort();
  if (!text.trim()) {
    showTranslation("");
    state.detected = null;
    showDetected();
    updateSwap();
    clearMessage();
    return;
  }
  if (!updateCounter()) {
    showMessage(
      `The text has ${text.length} characters; this server translates at most ${state.settings.charLimit} at a time. Shorten it.`,
    );
    return;
  }
  const controller = new AbortController();
  state.controller = controller;
  const sequence = ++state.sequence;
  const body = {
    q: text,
    source: $("source").value,
    target: $("target").value,
    format: "text",
    alternatives,
    confidence: true, // each sentence's, to mark the ones the model is unsure of
    ...glossaryFields(),
  };
  $("output").setAttribute("aria-busy", "true");
  try {
    const response = await call("/translate", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    const result = await response.json();
    if (sequence !== state.sequence) return; // a newer translation has started
    clearMessage();
    showTranslation(result.translatedText, result.terminology, result.sentenceConfidence || []);
    state.detected = result.detectedLanguage ? result.detectedLanguage.language : null;
    state.confidence = result.detectedLanguage ? result.detectedLanguage.confidence : null;
    showDetected();
    updateSwap();
    if (alternatives) showAlternatives(result.alternatives || []);
  } catch (err) {
    if (sequence === state.sequence) {
      handleError(err, "text", (next) => translateNow(next, alternatives), attempt);
    }
  } finally {
    if (sequence === state.sequence) $("output").setAttribute("aria-busy", "false");
  }
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

// Confidence (the model's estimate that a sentence's translation is good, 0-1; docs/confidence.md)
// below which a sentence is marked unsure, and below which doubtful.
const UNSURE = 0.5;
const DOUBTFUL = 0.8;

// The characters [start, end) of `chars`, each span of `spans` (sorted) inside them in a <mark>.
function marked(chars, start, end, spans, terms) {
  const parts = [];
  let at = start;
  for (const span of spans) {
    if (span.start < at || span.end <= span.start || span.end > end) continue;
    const mark = document.createElement("mark");
    mark.textContent = chars.slice(span.start, span.end).join("");
    mark.title = span.title;
    if (span.target === undefined) mark.className = "memory";
    else terms.push(`${span.source} → ${span.target}`);
    parts.push(chars.slice(at, span.start).join(""), mark);
    at = span.end;
  }
  parts.push(chars.slice(at, end).join(""));
  return parts.filter((part) => part !== "");
}

// The translation, each term a glossary or placeholder decided in a <mark>, and each sentence
// answered from the translation memory (`segments`; without them, the whole text) in a
// <mark class="memory">; each sentence the model is unsure of (`sentences`: the answer's
// sentenceConfidence) in a <span class="unsure"> or "doubtful", marked by its underline's style
// and named in the note under the text, not by colour alone. Text nodes only: nothing the model or
// the memory wrote is parsed.
function showTranslation(text, terminology = null, sentences = []) {
  state.translation = text;
  const chars = Array.from(text); // the server's offsets count characters, not UTF-16 units
  const info = terminology || { memory: false, terms: [] };
  const memory = info.memory ? info.segments || [{ start: 0, end: chars.length }] : [];
  const spans = [
    ...memory.map((span) => ({ ...span, title: "from translation memory" })),
    ...info.terms.map((term) => ({ ...term, title: `glossary: ${term.source} → ${term.target}` })),
  ].sort((a, b) => a.start - b.start);
  const terms = [];
  const parts = [];
  let at = 0;
  let unsure = 0;
  let doubtful = 0;
  for (const sentence of sentences) {
    if (sentence.confidence >= DOUBTFUL || sentence.start < at || sentence.end > chars.length) continue;
    const low = sentence.confidence < UNSURE;
    const wrap = document.createElement("span");
    wrap.className = low ? "unsure" : "doubtful";
    const percent = Math.round(sentence.confidence * 100);
    wrap.title = `${low ? "The model is unsure of this sentence" : "This sentence may be wrong"} (confidence ${percent} %)`;
    wrap.append(...marked(chars, sentence.start, sentence.end, spans, terms));
    parts.push(...marked(chars, at, sentence.start, spans, terms), wrap);
    at = sentence.end;
    if (low) unsure += 1;
    else doubtful += 1;
  }
  parts.push(...marked(chars, at, chars.length, spans, terms));
  $("output").replaceChildren(...parts);
  const notes = [];
  if (memory.length) notes.push("From translation memory.");
  if (terms.length) notes.push(`Glossary terms: ${terms.join("; ")}.`);
  if (unsure) notes.push(`${plural(unsure, "sentence")} the model is unsure of (wavy underline): check them.`);
  if (doubtful) notes.push(`${plural(doubtful, "sentence")} that may be wrong (dotted underline).`);
  $("terms-note").textContent = notes.join(" ");
  $("terms-note").hidden = notes.length === 0;
}

function showAlternatives(alternatives) {
  const list = $("alternative-list");
  const distinct = [...new Set(alternatives)].filter((a) => a && a !== state.translation);
  list.replaceChildren(
    ...(distinct.length ? distinct : ["(no other translation found)"]).map((text) => {
      const item = document.createElement("li");
      item.textContent = text;
      return item;
    }),
  );
  $("alternatives").hidden = false;
  $("more").setAttribute("aria-expanded", "true");
}

async function copyTranslation() {
  const text = state.translation;
  if (!text) return;
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) {
    // older browsers, or a page not allowed to use the clipboard API
    getSelection().selectAllChildren($("output"));
    document.execCommand("copy");
  }
  $("copied").textContent = "Copied";
  setTimeout(() => ($("copied").textContent = ""), 2000);
}

// --- glossaries --------------------------------------------------------------------------------

// The terms typed on the page, a line each: source<TAB>target or source,target (a term alone is
// kept untranslated, as an entry whose target is its source is).
function pageTerms() {
  const entries = [];
  for (const line of $("glossary-terms").value.split("\n")) {
    const cut = line.includes("\t") ? line.indexOf("\t") : line.indexOf(",");
    const source = (cut < 0 ? line : line.slice(0, cut)).trim();
    const target = (cut < 0 ? "" : line.slice(cut + 1)).trim() || source;
    if (source) entries.push({ source, target });
  }
  return entries;
}

// What a translation request carries: the stored glossary picked, the terms typed.
function glossaryFields() {
  const fields = {};
  if ($("glossary-id").value) fields.glossary_id = $("glossary-id").value;
  const terms = pageTerms();
  if (terms.length) fields.glossary = terms;
  return fields;
}

function updateGlossaryState() {
  const picked = state.glossaries.find((g) => g.id === $("glossary-id").value);
  const count = pageTerms().length;
  const parts = [];
  if (picked) parts.push(picked.name);
  if (count) parts.push(`${count} term${count === 1 ? "" : "s"} typed`);
  $("glossary-state").textContent = parts.join(" + ") || "none";
}

// The stored glossaries for the languages selected (any source while it is detected).
function fillGlossaries(wanted = $("glossary-id").value) {
  const primary = (code) => code.toLowerCase().split("-")[0];
  const source = $("source").value;
  const target = primary($("target").value);
  const fits = (g) =>
    primary(g.target_lang) === target && (source === "auto" || primary(g.source_lang) === primary(source));
  const options = state.glossaries.filter(fits).map((g) => ({
    code: g.id,
    name: `${g.name} (${g.source_lang} → ${g.target_lang}, ${g.entry_count} terms)`,
  }));
  fillSelect($("glossary-id"), [{ code: "", name: "None" }, ...options], wanted);
  updateGlossaryState();
}

async function loadGlossaries(wanted) {
  try {
    state.glossaries = (await getJson("/glossaries")).glossaries;
  } catch (_) {
    state.glossaries = []; // no key yet, or no store: typed terms still work
  }
  fillGlossaries(wanted);
}

// Stores the file chosen as a glossary from the language selected to the one selected, and picks it.
async function uploadGlossary(attempt = 0) {
  const file = $("glossary-file").files[0];
  const source = effectiveSource();
  const status = $("glossary-status");
  if (!source) {
    status.textContent = "Choose the language of the terms (From) first.";
    $("source").focus();
    return;
  }
  const form = new FormData();
  form.append("name", $("glossary-name").value.trim());
  form.append("source_lang", source);
  form.append("target_lang", $("target").value);
  form.append("file", file);
  const button = $("glossary-upload");
  button.disabled = true;
  status.textContent = `Uploading ${file.name}…`;
  try {
    const stored = await (await call("/glossaries", { method: "POST", body: form })).json();
    clearMessage();
    status.textContent = `Stored "${stored.name}": ${stored.entry_count} terms, ${stored.source_lang} → ${stored.target_lang}.`;
    $("glossary-form").reset();
    await loadGlossaries(stored.id);
    $("glossary-id").focus();
    translateNow();
  } catch (err) {
    status.textContent = "The glossary was not stored.";
    handleError(err, "file", (next) => uploadGlossary(next), attempt);
  } finally {
    button.disabled = false;
  }
}

// --- files: document jobs ----------------------------------------------------------------------

// A file goes to POST /jobs and is translated on the server while the page polls GET /jobs/{id}
// about once a second, showing its progress, until the job is done (a download link), failed (the
// reason) or cancelled. The list holds this session's jobs: their ids are kept in sessionStorage,
// so that a reload picks them up again. What the server wrote goes into text nodes only.
const JOBS_STORAGE = "nmt.jobs";
const POLL_MS = 1000;
const MAX_POLL_MS = 10_000; // the longest wait between polls while the server cannot be reached
const FINAL = new Set(["done", "failed", "cancelled", "gone"]); // "gone": expired, deleted (the page's own)
const STATE_WORDS = {
  queued: "Queued",
  reading: "Reading the file",
  translating: "Translating",
  writing: "Writing the translation",
  done: "Done",
  failed: "Failed",
  cancelled: "Cancelled",
  gone: "No longer on the server",
};

// [{name, extensions}]: /frontend/settings' filesFormats where the server sends them, else a format
// named by each of its extensions (supportedFilesFormat, LibreTranslate's list).
function fileFormats(settings) {
  if (Array.isArray(settings.filesFormats) && settings.filesFormats.length) {
    return settings.filesFormats.map((f) => ({ name: String(f.name), extensions: f.extensions || [] }));
  }
  return (settings.supportedFilesFormat || []).map((ext) => ({ name: ext, extensions: [ext] }));
}

function showFormats(settings) {
  const formats = fileFormats(settings);
  const listed = settings.supportedFilesFormat || [];
  const extensions = listed.length ? listed : formats.flatMap((f) => f.extensions);
  state.extensions = extensions.map((ext) => String(ext).toLowerCase());
  $("formats").textContent = formats
    .map(({ name, extensions }) =>
      extensions.length === 1 && extensions[0] === name ? name : `${name} (${extensions.join(", ")})`,
    )
    .join(", ");
  $("file").accept = state.extensions.join(",");
}

// ".txt" of "brief.txt", as the server reads it ("" for ".profile" or "README").
function extensionOf(name) {
  const dot = name.lastIndexOf(".");
  return dot > 0 && dot < name.length - 1 ? name.slice(dot).toLowerCase() : "";
}

// The name the server gives the translation: report.pdf -> report_en.pdf.
function translatedName(job) {
  const ext = extensionOf(job.name);
  return `${ext ? job.name.slice(0, -ext.length) : job.name}_${job.target}${ext}`;
}

function jobPath(id, tail = "") {
  return `/jobs/${encodeURIComponent(id)}${tail}`;
}

// The result's address, as the server gave it (no key: a link cannot carry a header); none
// unless it is http(s). A click downloads it with the key (downloadResult).
function resultHref(job) {
  let url;
  try {
    url = new URL(job.resultUrl, location.href);
  } catch (_) {
    return null;
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") return null;
  return url.href;
}

// The job's result fetched with the key's header (a link would have to put the key in its URL),
// then saved under the translation's name from an object URL.
async function downloadResult(id, event) {
  event.preventDefault();
  const entry = state.jobs.get(id);
  if (!entry) return;
  try {
    const blob = await (await call(jobPath(id, "/result"))).blob();
    const url = URL.createObjectURL(blob);
    const save = document.createElement("a");
    save.href = url;
    save.download = translatedName(entry.job);
    save.hidden = true;
    document.body.append(save);
    save.click();
    save.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000); // after the browser has taken it
  } catch (err) {
    if (err.status === 404) jobGone(id);
    else showMessage(explain(err, "file"));
  }
}

// The drop zone holds the file input itself (labelled, reached with Tab, opened with Enter or
// Space): a file dropped anywhere on it is put into the input, as if it had been chosen.
function wireDropZone() {
  const zone = $("drop-zone");
  const carriesFiles = (event) => Boolean(event.dataTransfer) && [...event.dataTransfer.types].includes("Files");
  const over = (event) => {
    if (!carriesFiles(event)) return;
    event.preventDefault();
    event.dataTransfer.dropEffect = "copy";
    zone.classList.add("dragging");
  };
  zone.addEventListener("dragenter", over);
  zone.addEventListener("dragover", over);
  zone.addEventListener("dragleave", (event) => {
    if (!zone.contains(event.relatedTarget)) zone.classList.remove("dragging");
  });
  zone.addEventListener("drop", (event) => {
    zone.classList.remove("dragging");
    const files = event.dataTransfer ? event.dataTransfer.files : null;
    if (!files || files.length === 0) return;
    event.preventDefault();
    const one = new DataTransfer(); // the input takes one file: the first dropped
    one.items.add(files[0]);
    $("file").files = one.files;
    $("file").dispatchEvent(new Event("change", { bubbles: true }));
    $("file").focus();
  });
  // A file dropped beside the zone would otherwise replace the page with the file.
  for (const type of ["dragover", "drop"]) {
    document.addEventListener(type, (event) => {
      const input = event.target instanceof HTMLInputElement && event.target.type === "file";
      if (carriesFiles(event) && !event.defaultPrevented && !input) {
        event.preventDefault();
        event.dataTransfer.dropEffect = "none";
      }
    });
  }
}

function announce(text) {
  $("jobs-status").textContent = text;
}

async function submitJob(attempt = 0) {
  const file = $("file").files[0];
  if (!file) {
    showMessage("Choose a file first.");
    $("file").focus();
    return;
  }
  const kind = extensionOf(file.name);
  if (state.extensions.length && !state.extensions.includes(kind)) {
    showMessage(
      `This server does not translate ${kind ? `${kind} files` : "files without an extension"}. Formats: ${$("formats").textContent}.`,
    );
    $("file").focus();
    return;
  }
  const form = new FormData();
  form.append("file", file);
  form.append("source", $("source").value);
  form.append("target", $("target").value);
  for (const [name, value] of Object.entries(glossaryFields())) {
    form.append(name, typeof value === "string" ? value : JSON.stringify(value));
  }
  const button = $("translate-file");
  button.disabled = true;
  try {
    const job = await (await call("/jobs", { method: "POST", body: form })).json();
    clearMessage();
    addJob(job);
  } catch (err) {
    handleError(err, "file", (next) => submitJob(next), attempt);
  } finally {
    button.disabled = false;
  }
}

let jobViews = 0; // numbers the ids of each job's elements

// One job's <li>, built once and updated in place by showJob.
function jobView(id) {
  const make = (tag, className) => {
    const element = document.createElement(tag);
    if (className) element.className = className;
    return element;
  };
  const n = ++jobViews;
  const view = {
    root: make("li", "job"),
    name: make("span", "job-name"),
    target: make("span", "muted"),
    state: make("span", "job-state"),
    progress: make("progress"),
    count: make("span", "job-count"),
    language: make("p", "note job-language"),
    notes: make("ul", "note job-notes"),
    error: make("p", "job-error"),
    cancel: make("button"),
    download: make("a", "download"),
  };
  view.root.dataset.id = id;
  view.root.tabIndex = -1; // where focus goes when the button that had it goes away
  view.name.id = `job-${n}-name`;
  view.count.id = `job-${n}-count`;
  view.root.setAttribute("aria-labelledby", view.name.id);
  view.progress.setAttribute("aria-labelledby", view.name.id);
  view.progress.setAttribute("aria-describedby", view.count.id);
  view.cancel.type = "button";
  view.cancel.textContent = "Cancel";
  view.cancel.addEventListener("click", () => cancelJob(id));
  view.download.addEventListener("click", (event) => downloadResult(id, event));
  const head = make("div", "job-head");
  head.append(view.name, " ", view.target, " ", view.state);
  const bar = make("div", "job-progress");
  bar.append(view.progress, " ", view.count);
  const actions = make("div", "row");
  actions.append(view.cancel, view.download);
  view.root.append(head, bar, view.language, view.notes, view.error, actions);
  return view;
}

function addJob(job) {
  if (state.jobs.has(job.id)) return showJob(job);
  const entry = { job: null, view: jobView(job.id), timer: null, failures: 0, cancelling: false };
  state.jobs.set(job.id, entry);
  $("jobs").prepend(entry.view.root); // newest first, as GET /jobs lists them
  $("jobs-panel").hidden = false;
  saveJobIds();
  showJob(job);
}

function showJob(job) {
  const entry = state.jobs.get(job.id);
  if (!entry) return;
  const before = entry.job ? entry.job.state : null;
  if (FINAL.has(before) && !FINAL.has(job.state)) return; // a poll answered after the cancel
  entry.job = job;
  const view = entry.view;
  const words = STATE_WORDS[job.state] || String(job.state);
  view.root.dataset.state = job.state;
  view.name.textContent = job.name;
  view.target.textContent = `→ ${nameOf(job.target)}`;
  view.state.textContent = words;

  const progress = job.progress || {};
  const done = Number(progress.done) || 0;
  const total = progress.total == null ? null : Number(progress.total);
  if (total != null && total >= 0) {
    view.progress.max = Math.max(total, 1);
    view.progress.value = total ? Math.min(done, total) : Number(job.state === "done");
    view.count.textContent = `${done} / ${total} sentences`;
  } else {
    view.progress.removeAttribute("value"); // not read yet: how many is not known
    view.count.textContent = done ? `${done} sentences` : "";
  }

  view.language.textContent = job.detectedLanguage ? `Detected: ${nameOf(job.detectedLanguage)}` : "";
  view.language.hidden = !job.detectedLanguage;
  const notes = Array.isArray(job.notes) ? job.notes : [];
  view.notes.replaceChildren(
    ...notes.map((note) => {
      const item = document.createElement("li");
      item.textContent = String(note);
      return item;
    }),
  );
  view.notes.hidden = notes.length === 0;
  const failure = job.state === "failed" ? jobFailure(job) : "";
  view.error.textContent = failure;
  view.error.hidden = !failure;

  const running = !FINAL.has(job.state);
  if (!running && document.activeElement === view.cancel) view.root.focus();
  view.cancel.hidden = !running;
  view.cancel.setAttribute("aria-label", `Cancel ${job.name}`);
  const href = job.state === "done" && job.resultUrl ? resultHref(job) : null;
  if (href) {
    view.download.href = href;
    view.download.download = translatedName(job);
    view.download.textContent = `Download ${translatedName(job)}`;
  }
  view.download.hidden = !href;

  if (before !== job.state) {
    announce(
      `${job.name}: ${words}${failure ? `. ${failure}` : ""}${href ? ". The translation can be downloaded." : ""}`,
    );
  }
  if (running) schedulePoll(job.id);
  else clearTimeout(entry.timer);
}

function jobFailure(job) {
  const error = job.error || {};
  if (!error.message) return "The translation failed.";
  return explain({ status: Number(error.status) || null, message: String(error.message) }, "file");
}

// The job's id was not found: it expired (its files are removed after a while) or was deleted.
function jobGone(id) {
  const entry = state.jobs.get(id);
  if (!entry) return;
  showJob({ ...entry.job, state: "gone", resultUrl: null });
  state.jobs.delete(id);
  saveJobIds();
}

function schedulePoll(id, delay = POLL_MS) {
  const entry = state.jobs.get(id);
  if (!entry) return;
  clearTimeout(entry.timer);
  entry.timer = setTimeout(() => pollJob(id), delay);
}

async function pollJob(id) {
  const entry = state.jobs.get(id);
  if (!entry || FINAL.has(entry.job.state)) return;
  try {
    const job = await getJson(jobPath(id));
    entry.failures = 0;
    showJob(job);
  } catch (err) {
    if (err.status === 404) return jobGone(id);
    if (err.status === 403) return showMessage(explain(err, "file")); // polled again once a key is saved
    // Unreachable, busy or failing for now: asked again later, less often each time.
    entry.failures += 1;
    const wait = Math.max((err.retryAfter || 0) * 1000, POLL_MS * 2 ** entry.failures);
    if (entry.failures >= 3) showMessage(`${explain(err, "file")} (still asking about ${entry.job.name})`, { kind: "busy" });
    schedulePoll(id, Math.min(wait, MAX_POLL_MS));
  }
}

async function cancelJob(id, attempt = 0) {
  const entry = state.jobs.get(id);
  if (!entry) return;
  const options = { method: "POST" };
  if (entry.cancelling) return;
  entry.cancelling = true; // (aria-disabled: a disabled button would lose the focus)
  entry.view.cancel.setAttribute("aria-disabled", "true");
  try {
    showJob(await (await call(jobPath(id, "/cancel"), options)).json());
    clearMessage();
  } catch (err) {
    if (err.status === 409) schedulePoll(id, 0); // it finished meanwhile: shown as it is
    else if (err.status === 404) jobGone(id);
    else handleError(err, "file", (next) => cancelJob(id, next), attempt);
  } finally {
    entry.cancelling = false;
    entry.view.cancel.removeAttribute("aria-disabled");
  }
}

function saveJobIds() {
  try {
    sessionStorage.setItem(JOBS_STORAGE, JSON.stringify([...state.jobs.keys()]));
  } catch (_) {
    /* storage refused: the list lasts as long as the page */
  }
}

// The jobs of this session, after a reload: each asked for again.
async function restoreJobs() {
  let ids = [];
  try {
    ids = JSON.parse(sessionStorage.getItem(JOBS_STORAGE) || "[]");
  } catch (_) {
    /* nothing kept */
  }
  for (const id of Array.isArray(ids) ? ids : []) { // oldest first: the newest ends on top
    try {
      addJob(await getJson(jobPath(String(id))));
    } catch (_) {
      /* expired, or not this key's */
    }
  }
  saveJobIds();
}

// Jobs whose polling stopped (a key refused): asked about again once a key is saved.
function resumeJobs() {
  for (const [id, entry] of state.jobs) if (!FINAL.has(entry.job.state)) schedulePoll(id, 0);
}

// --- tabs, key, start --------------------------------------------------------------------------

function selectTab(tab) {
  for (const other of document.querySelectorAll('[role="tab"]')) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    $(other.getAttribute("aria-controls")).hidden = !selected;
  }
  tab.focus();
}

function onTabKey(event) {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  const index = tabs.indexOf(event.target);
  const next = {
    ArrowRight: (index + 1) % tabs.length,
    ArrowLeft: (index - 1 + tabs.length) % tabs.length,
    Home: 0,
    End: tabs.length - 1,
  }[event.key];
  if (next === undefined) return;
  event.preventDefault();
  selectTab(tabs[next]);
}

function showKeyPanel(message) {
  $("key-panel").hidden = false;
  if (message) $("key-help").textContent = message;
  $("api-key").value = state.key;
  if (!state.key || message) $("api-key").focus();
}

function saveKey(event) {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  if (state.key) localStorage.setItem(KEY_STORAGE, state.key);
  else localStorage.removeItem(KEY_STORAGE);
  $("key-help").textContent = state.key ? "Key saved in this browser." : "Enter the key you were given.";
  clearMessage();
  loadGlossaries();
  resumeJobs();
  if ($("input").value.trim()) translateNow();
}

async function start(attempt = 0) {
  let settings, languages;
  try {
    [settings, languages] = await Promise.all([getJson("/frontend/settings"), getJson("/languages")]);
  } catch (err) {
    if (err.status === 503 || err.status === 0) {
      showMessage("The translation service is starting. Trying again…", { kind: "busy" });
      state.retryTimer = setTimeout(() => start(attempt + 1), 2000);
    } else {
      showMessage(`The page cannot start: ${err.message}`);
    }
    return;
  }
  clearMessage();
  state.settings = settings;
  state.languages = languages;
  try {
    state.maxAlternatives = (await getJson("/info")).limits.max_alternatives;
  } catch (_) {
    /* keep the default */
  }
  $("more").hidden = state.maxAlternatives < 1;
  const choices = sources().map(({ code, name }) => ({ code, name }));
  fillSelect($("source"), [{ code: "auto", name: "Detect language" }, ...choices], settings.language.source.code);
  fillTargets(settings.language.target.code);
  showFormats(settings);
  if (settings.keyRequired) showKeyPanel(null);
  updateCounter();
  loadGlossaries();
  restoreJobs();
}

function wire() {
  $("input").addEventListener("input", () => {
    updateCounter();
    scheduleTranslate();
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      translateNow();
    }
  });
  $("translate").addEventListener("click", () => translateNow());
  $("clear").addEventListener("click", () => {
    $("input").value = "";
    updateCounter();
    translateNow();
    $("input").focus();
  });
  $("source").addEventListener("change", () => {
    state.detected = null;
    fillTargets($("target").value);
    fillGlossaries();
    showDetected();
    translateNow();
  });
  $("target").addEventListener("change", () => {
    updateSwap();
    fillGlossaries();
    translateNow();
  });
  $("glossary-id").addEventListener("change", () => {
    updateGlossaryState();
    translateNow();
  });
  $("glossary-terms").addEventListener("input", () => {
    updateGlossaryState();
    scheduleTranslate();
  });
  $("glossary-form").addEventListener("submit", (event) => {
    event.preventDefault();
    uploadGlossary();
  });
  $("swap").addEventListener("click", swap);
  $("copy").addEventListener("click", copyTranslation);
  $("more").addEventListener("click", () => {
    if ($("more").getAttribute("aria-expanded") === "true") hideAlternatives();
    else translateNow(0, state.maxAlternatives);
  });
  $("file-form").addEventListener("submit", (event) => {
    event.preventDefault();
    submitJob();
  });
  wireDropZone();
  $("key-form").addEventListener("submit", saveKey);
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", onTabKey);
  }
}

wire();
start();
