// diffserve playground: a client of the server's public routes only (/server_info, /v1/loras,
// /v1/images/generations and /edits with "stream": true, /v1/videos and their chunk streams). No framework,
// no build, no CDN.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "diffserve-api-key"; // sessionStorage: this tab only
const GALLERY_STORE = "diffserve-gallery"; // localStorage: entries with a thumbnail and their parameters
const GALLERY_MAX = 50;
const THUMB_PX = 192;
const ACTIVE_VIDEO = new Set(["queued", "in_progress"]);

const state = {
  info: null, // /server_info
  model: "",
  tab: "generate",
  multiple: 16,
  running: null, // AbortController of the request in flight
  current: [], // the images shown in the viewer: {blob, url, entry}
  editImage: null, // {blob, width, height} of the edit tab's input
  controlImage: null, // the generate tab's ControlNet control image (a File)
  controlMask: null, // its mask (a File), for an inpainting ControlNet
  maskPainted: false,
  erasing: false,
  videoUrls: new Map(), // video id -> blob URL of its MP4
  videoPoll: null,
};

// ------------------------------------------------------------------------------------------------ API

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code;
    } else if (body && body.detail) {
      message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    }
  } catch (_) {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, code);
}

// fetch with the API key; a 401 asks for the key and tries again. Other errors throw ApiError.
async function api(path, options = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}), ...authHeaders() };
    const response = await fetch(path, { ...options, headers });
    if (response.status === 401) {
      const err = await errorOf(response);
      $("key-button").hidden = false;
      await askKey(err.message);
      continue;
    }
    if (!response.ok) throw await errorOf(response);
    return response;
  }
}

// One dialog at a time: requests that get a 401 while it is open wait for the same answer.
let keyPrompt = null;
function askKey(reason) {
  if (!keyPrompt) keyPrompt = promptKey(reason).finally(() => (keyPrompt = null));
  return keyPrompt;
}

function promptKey(reason) {
  return new Promise((resolve, reject) => {
    const dialog = $("key-dialog");
    $("key-reason").textContent = reason || "This server requires an API key.";
    $("key-input").value = sessionStorage.getItem(KEY_STORE) || "";
    const onClose = () => {
      dialog.removeEventListener("close", onClose);
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "ok" && key) {
        sessionStorage.setItem(KEY_STORE, key);
        resolve();
      } else {
        reject(new ApiError(401, `API key needed: ${reason}`, "invalid_api_key"));
      }
    };
    dialog.returnValue = "";
    dialog.addEventListener("close", onClose);
    dialog.showModal();
  });
}

// The events of a text/event-stream response: {event, data (parsed JSON)}.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
    }
  }
}

// ------------------------------------------------------------------------------------------ messages

function showError(message) {
  $("alert-text").textContent = message;
  $("alert").hidden = false;
}

function clearError() {
  $("alert").hidden = true;
}

function setProgress(fraction, text) {
  $("progress").hidden = false;
  $("progress-bar").style.width = `${Math.round(Math.max(0, Math.min(1, fraction)) * 100)}%`;
  $("progress-text").textContent = text;
}

// ------------------------------------------------------------------------------------------- helpers

function b64ToBlob(b64, type) {
  const bytes = atob(b64);
  const out = new Uint8Array(bytes.length);
  for (let i = 0; i < bytes.length; i++) out[i] = bytes.charCodeAt(i);
  return new Blob([out], { type });
}

function loadImage(src) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("could not read the image"));
    img.src = src;
  });
}

async function thumbnail(blob) {
  const url = URL.createObjectURL(blob);
  try {
    const img = await loadImage(url);
    const scale = Math.min(1, THUMB_PX / Math.max(img.naturalWidth, img.naturalHeight));
    const canvas = document.createElement("canvas");
    canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
    canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
    canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
    return canvas.toDataURL("image/jpeg", 0.8);
  } finally {
    URL.revokeObjectURL(url);
  }
}

function randomSeed() {
  const words = new Uint32Array(1);
  crypto.getRandomValues(words);
  return words[0] >>> 1; // 0 .. 2^31-1
}

function numberOrNull(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

function roundTo(value, multiple) {
  return Math.max(multiple, Math.round(value / multiple) * multiple);
}

// --------------------------------------------------------------------- full images kept in IndexedDB

let dbPromise = null;
function db() {
  if (!dbPromise) {
    dbPromise = new Promise((resolve, reject) => {
      const open = indexedDB.open("diffserve-webui", 1);
      open.onupgradeneeded = () => open.result.createObjectStore("images");
      open.onsuccess = () => resolve(open.result);
      open.onerror = () => reject(open.error);
    });
  }
  return dbPromise;
}

async function idb(mode, work) {
  const database = await db();
  return new Promise((resolve, reject) => {
    const tx = database.transaction("images", mode);
    const request = work(tx.objectStore("images"));
    tx.oncomplete = () => resolve(request && request.result);
    tx.onerror = () => reject(tx.error);
  });
}

const imageStore = {
  put: (id, blob) => idb("readwrite", (s) => s.put(blob, id)),
  get: (id) => idb("readonly", (s) => s.get(id)),
  remove: (id) => idb("readwrite", (s) => s.delete(id)),
  clear: () => idb("readwrite", (s) => s.clear()),
};

// ----------------------------------------------------------------------------------------- gallery

function galleryEntries() {
  try {
    const entries = JSON.parse(localStorage.getItem(GALLERY_STORE) || "[]");
    return Array.isArray(entries) ? entries : [];
  } catch (_) {
    return [];
  }
}

function saveGallery(entries) {
  for (;;) {
    try {
      localStorage.setItem(GALLERY_STORE, JSON.stringify(entries));
      return entries;
    } catch (err) {
      if (entries.length === 0) throw err;
      const dropped = entries.pop(); // storage full: the oldest goes first
      imageStore.remove(dropped.id).catch(() => {});
    }
  }
}

async function addToGallery(entry, blob) {
  let entries = [entry, ...galleryEntries()];
  for (const old of entries.slice(GALLERY_MAX)) imageStore.remove(old.id).catch(() => {});
  entries = saveGallery(entries.slice(0, GALLERY_MAX));
  try {
    await imageStore.put(entry.id, blob);
  } catch (err) {
    showError(`This browser keeps only the thumbnail of this image (IndexedDB: ${err.message || err})`);
  }
  renderGallery();
  return entries;
}

function renderGallery() {
  const box = $("gallery");
  box.replaceChildren();
  const entries = galleryEntries();
  if (!entries.length) {
    const p = document.createElement("p");
    p.className = "hint";
    p.textContent = "Nothing yet: generated images are kept here (in this browser only).";
    box.append(p);
    return;
  }
  for (const entry of entries) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "gallery-item";
    button.dataset.id = entry.id;
    button.title = `${entry.params.prompt}\n${entry.size} · seed ${entry.seed}`;
    const img = document.createElement("img");
    img.src = entry.thumb;
    img.alt = entry.params.prompt;
    button.append(img);
    button.addEventListener("click", () => openEntry(entry));
    box.append(button);
  }
}

async function openEntry(entry) {
  reuse(entry);
  let blob = null;
  try {
    blob = await imageStore.get(entry.id);
  } catch (_) {
    blob = null;
  }
  if (!blob) blob = b64ToBlob(entry.thumb.split(",")[1], "image/jpeg");
  showResults([{ blob, entry }]);
}

// ----------------------------------------------------------------------------------------- viewer

function showResults(items, partial = false) {
  for (const old of state.current) URL.revokeObjectURL(old.url);
  state.current = items.map((item) => ({ ...item, url: URL.createObjectURL(item.blob) }));
  const box = $("results");
  box.replaceChildren();
  for (const item of state.current) {
    const img = document.createElement("img");
    img.src = item.url;
    img.alt = partial ? "preview" : item.entry ? item.entry.params.prompt : "result";
    img.className = partial ? "partial" : "final";
    img.onload = () => img.classList.toggle("small", img.naturalWidth < 256);
    box.append(img);
  }
  $("viewer-empty").hidden = state.current.length > 0;
  const first = state.current[0];
  if (!partial && first && first.entry) {
    $("details").hidden = false;
    $("params").textContent = JSON.stringify(
      { ...first.entry.params, seed: first.entry.seed, size: first.entry.size },
      null,
      1,
    );
    const ext = (first.blob.type.split("/")[1] || "png").replace("jpeg", "jpg");
    $("download").href = first.url;
    $("download").download = `diffserve-${first.entry.seed}-${first.entry.id.slice(0, 8)}.${ext}`;
    $("use-as-input").hidden = $("tab-edit").hidden;
  } else if (partial) {
    $("details").hidden = true;
  }
}

// ------------------------------------------------------------------------------------ model setup

function sizePresets(defaultW, defaultH, multiple) {
  const area = defaultW && defaultH ? defaultW * defaultH : 1024 * 1024;
  const ratios = [[1, 1], [4, 3], [3, 4], [3, 2], [2, 3], [16, 9], [9, 16]];
  const seen = new Set();
  const out = [];
  for (const [rw, rh] of ratios) {
    const w = roundTo(Math.sqrt((area * rw) / rh), multiple);
    const h = roundTo(area / w, multiple);
    const key = `${w}x${h}`;
    if (!seen.has(key)) {
      seen.add(key);
      out.push({ key, label: `${key} (${rw}:${rh})` });
    }
  }
  return out;
}

function fillSizes(defaults) {
  const select = $("size");
  select.replaceChildren();
  const add = (value, label) => {
    const option = document.createElement("option");
    option.value = value;
    option.textContent = label;
    select.append(option);
  };
  const w = defaults.width;
  const h = defaults.height;
  if (!w || !h || state.tab === "edit") add("auto", "auto (the input image's)");
  for (const preset of sizePresets(w, h, state.multiple)) add(preset.key, preset.label);
  add("custom", "custom…");
  if (w && h && state.tab !== "edit") select.value = `${w}x${h}`;
  for (const id of ["width", "height"]) {
    $(id).step = state.multiple;
    $(id).min = state.multiple;
  }
  $("width").placeholder = w || 1024;
  $("height").placeholder = h || 1024;
  $("custom-size").hidden = select.value !== "custom";
}

function placeholder(id, value, suffix = " (default)") {
  $(id).placeholder = value === null || value === undefined ? "model default" : `${value}${suffix}`;
}

function configure(info) {
  state.info = info;
  state.model = info.model;
  const engine = info.engine || {};
  const defaults = engine.default_params || {};
  state.multiple = engine.pixel_multiple || 16;
  const video = engine.video;
  const family = engine.family || "?";
  const task = engine.task || "";
  const line = $("model-line");
  line.replaceChildren();
  const name = document.createElement("b");
  name.textContent = info.model;
  line.append(name, ` · ${family} · ${task} · ${engine.state || ""}`);

  $("tab-generate").hidden = Boolean(video) || Boolean(engine.requires_input_image);
  $("tab-edit").hidden = Boolean(video) || !(engine.max_input_images > 0);
  $("tab-video").hidden = !video;
  $("reference-label").hidden = task !== "image-to-video";
  if (video) {
    $("num-frames").step = video.temporal_factor;
    $("fps").max = video.max_fps;
    placeholder("num-frames", defaults.num_frames);
    placeholder("fps", defaults.fps);
  }
  placeholder("steps", defaults.num_inference_steps);
  const maxSteps = ((info.server_args || {}).engine_args || {}).max_inference_steps;
  if (maxSteps) $("steps").max = maxSteps;
  $("guidance-label").hidden = defaults.guidance_scale === null || defaults.guidance_scale === undefined;
  $("true-cfg-label").hidden = defaults.true_cfg_scale === null || defaults.true_cfg_scale === undefined;
  placeholder("guidance", defaults.guidance_scale);
  placeholder("true-cfg", defaults.true_cfg_scale);
  placeholder("strength", defaults.strength);
  configureControlNets(engine.controlnets || []);
  const first = ["generate", "edit", "video"].find((tab) => !$(`tab-${tab}`).hidden);
  selectTab(first || "generate");
}

function selectTab(tab) {
  state.tab = tab;
  for (const button of document.querySelectorAll(".tabs button")) {
    button.setAttribute("aria-selected", String(button.dataset.tab === tab));
  }
  $("edit-inputs").hidden = tab !== "edit";
  $("video-inputs").hidden = tab !== "video";
  $("controlnet-box").hidden = tab !== "generate" || !controlNets().length;
  $("video-jobs").hidden = tab !== "video";
  $("gallery-box").hidden = tab === "video";
  $("viewer").hidden = tab === "video";
  if (tab === "video") $("details").hidden = $("progress").hidden = true;
  $("n-label").hidden = tab === "video";
  $("previews-label").hidden = tab === "video";
  $("run").textContent = { generate: "Generate", edit: "Edit image", video: "Create video" }[tab];
  fillSizes((state.info && state.info.engine && state.info.engine.default_params) || {});
  if (tab === "video") refreshJobs();
}

// The ControlNets the server loaded (/server_info's engine.controlnets: [{name, modes, inpainting}]), if any.
function controlNets() {
  return (state.info && state.info.engine && state.info.engine.controlnets) || [];
}

function configureControlNets(nets) {
  const select = $("controlnet-name");
  select.replaceChildren(Object.assign(document.createElement("option"), { value: "", textContent: "none" }));
  for (const net of nets) {
    select.append(Object.assign(document.createElement("option"), { value: net.name, textContent: net.name }));
  }
  $("controlnet-count").textContent = nets.length ? `(${nets.length} loaded)` : "";
  showControlMode();
}

// The chosen ControlNet's own inputs: a Union one's mode, an inpainting one's mask.
function showControlMode() {
  const net = controlNets().find((n) => n.name === $("controlnet-name").value);
  const modes = net ? net.modes : null;
  $("control-mode-label").hidden = !modes;
  if (modes) $("control-mode").max = modes - 1;
  $("control-mask-label").hidden = !(net && net.inpainting);
}

function fileToDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`${file.name} could not be read`));
    reader.readAsDataURL(file);
  });
}

// The request's `controlnets` field (generate tab): the chosen ControlNet with its control image, or null.
async function chosenControlNets() {
  const name = $("controlnet-name").value;
  if (state.tab !== "generate" || !name) return null;
  if (!state.controlImage) throw new Error(`choose a control image for the ControlNet ${name}`);
  const entry = {
    name,
    image: await fileToDataUrl(state.controlImage),
    scale: numberOrNull("control-scale") ?? 1,
    start: numberOrNull("control-start") ?? 0,
    end: numberOrNull("control-end") ?? 1,
  };
  if (!$("control-mode-label").hidden) entry.mode = numberOrNull("control-mode") ?? 0;
  if (!$("control-mask-label").hidden) {
    if (!state.controlMask) throw new Error(`choose a mask (white = repaint) for the inpainting ControlNet ${name}`);
    entry.mask = await fileToDataUrl(state.controlMask);
  }
  return [entry];
}

async function loadLoras() {
  const list = $("lora-list");
  let adapters = [];
  try {
    adapters = (await (await api("/v1/loras")).json()).data || [];
  } catch (err) {
    list.replaceChildren(Object.assign(document.createElement("p"), { className: "hint", textContent: err.message }));
    return;
  }
  $("lora-count").textContent = adapters.length ? `(${adapters.length})` : "";
  if (!adapters.length) return;
  list.replaceChildren();
  for (const adapter of adapters) {
    const row = document.createElement("div");
    row.className = "lora";
    const label = document.createElement("label");
    const check = document.createElement("input");
    check.type = "checkbox";
    check.dataset.lora = adapter.name;
    label.append(check, adapter.name);
    const scale = document.createElement("input");
    scale.type = "number";
    scale.step = "0.05";
    scale.value = "1";
    scale.title = "strength (scale)";
    scale.dataset.loraScale = adapter.name;
    row.append(label, scale);
    list.append(row);
  }
}

function chosenLoras() {
  const out = [];
  for (const check of document.querySelectorAll("[data-lora]")) {
    if (!check.checked) continue;
    const scale = document.querySelector(`[data-lora-scale="${CSS.escape(check.dataset.lora)}"]`);
    out.push({ name: check.dataset.lora, scale: Number(scale.value || 1) });
  }
  return out;
}

async function refreshLoad() {
  try {
    const info = await (await api("/server_info")).json();
    const engine = info.engine || {};
    $("server-load").textContent = `${engine.waiting} waiting · ${engine.running} running`;
    return engine;
  } catch (_) {
    return null;
  }
}

// ------------------------------------------------------------------------------------ the request

// The request's parameters from the form (only the fields set: the model's defaults otherwise).
function formParams() {
  const p = { prompt: $("prompt").value.trim(), model: state.model };
  const negative = $("negative-prompt").value.trim();
  if (negative) p.negative_prompt = negative;
  let size = $("size").value;
  if (size === "custom") {
    const w = numberOrNull("width");
    const h = numberOrNull("height");
    if (!w || !h) throw new Error("enter a width and a height for a custom size");
    size = `${w}x${h}`;
  }
  if (size !== "auto") p.size = size;
  const fields = [
    ["steps", "num_inference_steps"],
    ["seed", "seed"],
    ["strength", "strength", "edit"],
    ["num-frames", "num_frames", "video"],
    ["fps", "fps", "video"],
  ];
  if (!$("guidance-label").hidden) fields.push(["guidance", "guidance_scale"]);
  if (!$("true-cfg-label").hidden && state.tab !== "video") fields.push(["true-cfg", "true_cfg_scale"]);
  for (const [id, name, tab] of fields) {
    if (tab && tab !== state.tab) continue;
    const value = numberOrNull(id);
    if (value !== null) p[name] = value;
  }
  if (state.tab !== "video") p.n = numberOrNull("n") || 1;
  const quality = $("quality").value;
  if (quality) p.quality = quality;
  const loras = chosenLoras();
  if (loras.length) p.loras = loras;
  return p;
}

function reuse(entry) {
  const p = entry.params;
  if (!$(`tab-${entry.tab}`).hidden && entry.tab !== state.tab) selectTab(entry.tab);
  $("prompt").value = p.prompt || "";
  $("negative-prompt").value = p.negative_prompt || "";
  const size = p.size || "auto";
  const has = [...$("size").options].some((o) => o.value === size);
  if (has) {
    $("size").value = size;
  } else if (size !== "auto") {
    $("size").value = "custom";
    const [w, h] = size.split("x");
    $("width").value = w;
    $("height").value = h;
  }
  $("custom-size").hidden = $("size").value !== "custom";
  const set = (id, value) => {
    $(id).value = value === undefined || value === null ? "" : value;
  };
  set("steps", p.num_inference_steps);
  set("guidance", p.guidance_scale);
  set("true-cfg", p.true_cfg_scale);
  set("strength", p.strength);
  set("seed", entry.seed);
  set("n", p.n || 1);
  $("quality").value = p.quality || "";
  for (const check of document.querySelectorAll("[data-lora]")) {
    const used = (p.loras || []).find((l) => l.name === check.dataset.lora);
    check.checked = Boolean(used);
    if (used) document.querySelector(`[data-lora-scale="${CSS.escape(used.name)}"]`).value = used.scale;
  }
}

function setRunning(controller) {
  state.running = controller;
  $("run").disabled = Boolean(controller);
  $("cancel").hidden = !controller;
}

async function runImages() {
  const params = formParams();
  if (!params.prompt) throw new Error("write a prompt first");
  const previews = Math.max(0, Math.min(3, numberOrNull("partial-images") ?? 0));
  const edit = state.tab === "edit";
  let options;
  if (edit) {
    if (!state.editImage) throw new Error("choose an input image first");
    const form = new FormData();
    form.append("image", state.editImage.blob, "image.png");
    if (state.maskPainted) form.append("mask", await maskBlob(), "mask.png");
    for (const [name, value] of Object.entries(params)) {
      form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
    }
    form.append("stream", "true");
    form.append("partial_images", String(previews));
    options = { method: "POST", body: form };
  } else {
    // The control image goes in the request only: the gallery keeps the parameters without it.
    const controlnets = await chosenControlNets();
    const body = { ...params, stream: true, partial_images: previews };
    if (controlnets) body.controlnets = controlnets;
    options = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  }
  const controller = new AbortController();
  setRunning(controller);
  const started = performance.now();
  let phase = "queued";
  const tick = setInterval(async () => {
    const seconds = ((performance.now() - started) / 1000).toFixed(0);
    if (phase === "queued") {
      const engine = await refreshLoad();
      const load = engine ? ` (${engine.waiting} waiting, ${engine.running} running on the server)` : "";
      if (phase === "queued") setProgress(0.02, `queued${load} · ${seconds} s`);
    }
  }, 1000);
  setProgress(0.02, "queued");
  if (window.matchMedia("(max-width: 760px)").matches) $("progress").scrollIntoView({ behavior: "smooth" });
  const finals = [];
  try {
    const route = edit ? "/v1/images/edits" : "/v1/images/generations";
    const response = await api(route, { ...options, signal: controller.signal });
    for await (const { event, data } of sseEvents(response)) {
      if (event === "error" || data.type === "error") {
        throw new ApiError(data.error ? data.error.status || 500 : 500, (data.error || {}).message || "the request failed");
      }
      const type = `image/${data.output_format || "png"}`;
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      if (event.endsWith(".partial_image")) {
        phase = "running";
        const index = data.partial_image_index;
        setProgress((index + 1) / (previews + 1), `preview ${index + 1} of ${previews} · ${seconds} s`);
        showResults([{ blob: b64ToBlob(data.b64_json, type) }], true);
      } else if (event.endsWith(".completed")) {
        phase = "running";
        const blob = b64ToBlob(data.b64_json, type);
        const entry = {
          id: crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`,
          created: Date.now(),
          tab: edit ? "edit" : "generate",
          params,
          seed: data.seed,
          size: data.size,
          thumb: await thumbnail(blob),
        };
        finals.push({ blob, entry });
        setProgress(1, `image ${finals.length} of ${params.n || 1} done · ${seconds} s`);
        showResults(finals);
      }
    }
    if (!finals.length) throw new Error("the server's stream ended without an image");
    for (const item of finals) await addToGallery(item.entry, item.blob);
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    setProgress(1, `done in ${seconds} s`);
  } catch (err) {
    if (err.name === "AbortError") {
      setProgress(0, "cancelled");
    } else {
      setProgress(0, "failed");
      throw err;
    }
  } finally {
    clearInterval(tick);
    setRunning(null);
    refreshLoad();
  }
}

// ------------------------------------------------------------------------------------- edit canvas

async function setEditImage(blob) {
  const url = URL.createObjectURL(blob);
  try {
    const img = await loadImage(url);
    const w = img.naturalWidth;
    const h = img.naturalHeight;
    for (const canvas of [$("edit-canvas"), $("mask-canvas")]) {
      canvas.width = w;
      canvas.height = h;
    }
    $("edit-canvas").getContext("2d").drawImage(img, 0, 0);
    $("mask-canvas").getContext("2d").clearRect(0, 0, w, h);
    state.editImage = { blob, width: w, height: h };
    state.maskPainted = false;
    // The brush unless the server says the model cannot inpaint (an `inpainting` field of /server_info's
    // engine, when the server reports one; without it a mask the model cannot use gets the server's 400).
    $("mask-tools").hidden = (state.info.engine || {}).inpainting === false;
    $("brush-size").max = Math.max(8, Math.round(Math.max(w, h) / 3));
    $("brush-size").value = Math.max(2, Math.round(Math.max(w, h) / 12));
  } finally {
    URL.revokeObjectURL(url);
  }
}

function setupMask() {
  const canvas = $("mask-canvas");
  const ctx = canvas.getContext("2d");
  let last = null;
  const point = (event) => {
    const rect = canvas.getBoundingClientRect();
    return {
      x: ((event.clientX - rect.left) / rect.width) * canvas.width,
      y: ((event.clientY - rect.top) / rect.height) * canvas.height,
    };
  };
  const stroke = (from, to) => {
    ctx.globalCompositeOperation = state.erasing ? "destination-out" : "source-over";
    ctx.strokeStyle = "rgb(255, 40, 90)";
    ctx.fillStyle = "rgb(255, 40, 90)";
    ctx.lineWidth = Number($("brush-size").value);
    ctx.lineCap = "round";
    ctx.beginPath();
    ctx.moveTo(from.x, from.y);
    ctx.lineTo(to.x, to.y);
    ctx.stroke();
    if (!state.erasing) state.maskPainted = true;
  };
  canvas.addEventListener("pointerdown", (event) => {
    canvas.setPointerCapture(event.pointerId);
    last = point(event);
    stroke(last, last);
  });
  canvas.addEventListener("pointermove", (event) => {
    if (!last) return;
    const next = point(event);
    stroke(last, next);
    last = next;
  });
  const end = () => {
    last = null;
  };
  canvas.addEventListener("pointerup", end);
  canvas.addEventListener("pointercancel", end);
  $("mask-clear").addEventListener("click", () => {
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    state.maskPainted = false;
  });
  $("mask-erase").addEventListener("click", () => {
    state.erasing = !state.erasing;
    $("mask-erase").textContent = state.erasing ? "Brush" : "Eraser";
  });
}

// The mask as OpenAI's edits take it: the input image's size, opaque where the image is kept and
// transparent where it was painted (the area to change).
function maskBlob() {
  const painted = $("mask-canvas");
  const out = document.createElement("canvas");
  out.width = painted.width;
  out.height = painted.height;
  const ctx = out.getContext("2d");
  ctx.fillStyle = "#000";
  ctx.fillRect(0, 0, out.width, out.height);
  ctx.globalCompositeOperation = "destination-out";
  ctx.drawImage(painted, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

// ------------------------------------------------------------------------------------------- video

async function runVideo() {
  const params = formParams();
  if (!params.prompt) throw new Error("write a prompt first");
  delete params.n;
  params.stream = true; // its chunks play as they are decoded (playLive)
  const file = $("video-reference").files[0];
  let options;
  if (file) {
    const form = new FormData();
    form.append("input_reference", file, file.name);
    for (const [name, value] of Object.entries(params)) {
      form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
    }
    options = { method: "POST", body: form };
  } else {
    options = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(params) };
  }
  setRunning(new AbortController());
  let job;
  try {
    job = await (await api("/v1/videos", options)).json(); // the job shows in the list below, with its progress
  } finally {
    setRunning(null);
  }
  playLive(job).catch((err) => showError(`live playback: ${err.message || err}`));
  await refreshJobs();
}

// A streamed job plays while it is decoded: the init segment and each chunk's media segment of
// GET /v1/videos/{id}/stream (fragmented MP4) appended in order to a MediaSource. Where the browser's
// MediaSource cannot play the type, the job plays from its file once completed, as every job does.
async function playLive(job) {
  const box = $("live-video");
  const response = await api(`/v1/videos/${encodeURIComponent(job.id)}/stream`);
  const video = document.createElement("video");
  Object.assign(video, { id: "live-player", muted: true, playsInline: true, controls: true, autoplay: true });
  const label = Object.assign(document.createElement("div"), { className: "meta", textContent: `live: ${job.prompt}` });
  let source = null;
  let buffer = null;
  const queue = [];
  let ended = false;
  const pump = () => {
    if (!buffer || buffer.updating || source.readyState !== "open") return;
    if (queue.length) buffer.appendBuffer(queue.shift());
    else if (ended) source.endOfStream();
  };
  for await (const { event, data } of sseEvents(response)) {
    if (event === "video.init") {
      if (!window.MediaSource || !MediaSource.isTypeSupported(data.mime_type)) {
        video.dataset.unsupported = data.mime_type; // the player below plays the file once completed
        continue;
      }
      source = new MediaSource();
      video.src = URL.createObjectURL(source);
      box.replaceChildren(label, video);
      box.hidden = false;
      await new Promise((resolve) => source.addEventListener("sourceopen", resolve, { once: true }));
      buffer = source.addSourceBuffer(data.mime_type);
      buffer.addEventListener("updateend", pump);
      queue.push(base64Bytes(data.data));
    } else if (event === "video.chunk" && source) {
      queue.push(base64Bytes(data.data));
      video.dataset.chunks = String(data.index + 1);
      label.textContent = `live: chunk ${data.index + 1}, up to ${data.end_time.toFixed(2)} s · ${job.prompt}`;
    } else if (event === "video.done") {
      ended = true;
      label.textContent = `${data.video.status}: ${job.prompt}`;
      refreshJobs();
    }
    pump();
  }
}

function base64Bytes(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

async function videoUrl(id) {
  if (!state.videoUrls.has(id)) {
    const blob = await (await api(`/v1/videos/${encodeURIComponent(id)}/content`)).blob();
    state.videoUrls.set(id, URL.createObjectURL(blob));
  }
  return state.videoUrls.get(id);
}

async function refreshJobs() {
  clearTimeout(state.videoPoll);
  if (state.tab !== "video") return;
  let jobs;
  try {
    jobs = (await (await api("/v1/videos?limit=20")).json()).data || [];
  } catch (err) {
    $("job-list").replaceChildren(Object.assign(document.createElement("p"), { className: "hint", textContent: err.message }));
    state.videoPoll = setTimeout(refreshJobs, 3000);
    return;
  }
  await renderJobs(jobs);
  if (jobs.some((job) => ACTIVE_VIDEO.has(job.status))) state.videoPoll = setTimeout(refreshJobs, 1000);
}

async function renderJobs(jobs) {
  const list = $("job-list");
  if (!jobs.length) {
    list.replaceChildren(Object.assign(document.createElement("p"), { className: "hint", textContent: "No jobs yet." }));
    return;
  }
  const rows = [];
  for (const job of jobs) {
    const row = document.createElement("div");
    row.className = "job";
    row.dataset.id = job.id;
    row.dataset.status = job.status;
    const meta = document.createElement("div");
    meta.className = "meta";
    const status = document.createElement("b");
    status.className = `status-${job.status}`;
    status.textContent = job.status;
    const phase = job.status === "in_progress" && job.phase ? ` (${job.phase}, ${job.progress}%)` : "";
    const error = job.error ? ` · ${job.error.message}` : "";
    meta.append(status, `${phase} · ${job.size || ""} · ${job.seconds || "?"} s · seed ${job.seed ?? "?"} · ${job.prompt}${error}`);
    row.append(meta);
    if (ACTIVE_VIDEO.has(job.status)) {
      const bar = document.createElement("div");
      bar.className = "bar";
      const fill = document.createElement("div");
      fill.style.width = `${job.progress || 0}%`;
      bar.append(fill);
      row.append(bar);
    }
    const actions = document.createElement("div");
    actions.className = "row";
    if (job.status === "completed") {
      try {
        const url = await videoUrl(job.id);
        const video = document.createElement("video");
        video.controls = true;
        video.loop = true;
        video.muted = true;
        video.playsInline = true;
        video.preload = "auto";
        video.src = url;
        row.append(video);
        const link = document.createElement("a");
        link.className = "button ghost";
        link.href = url;
        link.download = `${job.id}.mp4`;
        link.textContent = "Download";
        actions.append(link);
      } catch (err) {
        meta.append(` · ${err.message}`);
      }
    }
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "ghost";
    remove.textContent = ACTIVE_VIDEO.has(job.status) ? "Cancel" : "Delete";
    remove.addEventListener("click", async () => {
      try {
        await api(`/v1/videos/${encodeURIComponent(job.id)}`, { method: "DELETE" });
      } catch (err) {
        showError(err.message);
      }
      refreshJobs();
    });
    actions.append(remove);
    row.append(actions);
    rows.push(row);
  }
  list.replaceChildren(...rows);
}

// ------------------------------------------------------------------------------------------- wiring

async function submit(event) {
  event.preventDefault();
  if (state.running) return;
  clearError();
  try {
    if (state.tab === "video") await runVideo();
    else await runImages();
  } catch (err) {
    showError(err.message || String(err));
  }
}

function wire() {
  $("form").addEventListener("submit", submit);
  $("cancel").addEventListener("click", () => state.running && state.running.abort());
  $("alert-close").addEventListener("click", clearError);
  $("seed-random").addEventListener("click", () => {
    $("seed").value = randomSeed();
  });
  $("size").addEventListener("change", () => {
    $("custom-size").hidden = $("size").value !== "custom";
  });
  for (const button of document.querySelectorAll(".tabs button")) {
    button.addEventListener("click", () => selectTab(button.dataset.tab));
  }
  $("key-button").addEventListener("click", () => askKey("Enter the server's API key.").catch(() => {}));
  $("reuse").addEventListener("click", () => state.current[0] && state.current[0].entry && reuse(state.current[0].entry));
  $("use-as-input").addEventListener("click", async () => {
    const first = state.current[0];
    if (!first) return;
    selectTab("edit");
    await setEditImage(first.blob);
  });
  $("edit-file").addEventListener("change", async () => {
    const file = $("edit-file").files[0];
    if (!file) return;
    try {
      await setEditImage(file);
    } catch (err) {
      showError(err.message);
    }
  });
  $("control-file").addEventListener("change", () => {
    state.controlImage = $("control-file").files[0] || null;
  });
  $("control-mask-file").addEventListener("change", () => {
    state.controlMask = $("control-mask-file").files[0] || null;
  });
  $("controlnet-name").addEventListener("change", showControlMode);
  $("gallery-clear").addEventListener("click", () => {
    if (!confirm("Remove every image of this browser's gallery?")) return;
    localStorage.removeItem(GALLERY_STORE);
    imageStore.clear().catch(() => {});
    renderGallery();
  });
  setupMask();
}

async function start() {
  wire();
  renderGallery();
  for (;;) {
    try {
      const info = await (await api("/server_info")).json();
      if (!(info.engine && info.engine.default_params)) {
        // the engine has not reported its model yet (loading, warm-up): ask again shortly
        $("model-line").textContent = `${info.model} · ${(info.engine && info.engine.state) || "starting"}…`;
        await new Promise((resolve) => setTimeout(resolve, 2000));
        continue;
      }
      configure(info);
      break;
    } catch (err) {
      $("model-line").textContent = "not connected";
      showError(`Could not read /server_info: ${err.message}`);
      if (err.status === 401) continue; // the key dialog was dismissed: ask again
      return;
    }
  }
  refreshLoad();
  loadLoras();
}

document.addEventListener("DOMContentLoaded", start);
