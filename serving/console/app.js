// simsearch console: one page, four views (#search, #health, #versions, #duplicates), over the
// server's HTTP/JSON API (/v1/...). No framework, no build step, nothing fetched from elsewhere.
// Everything the server sends is shown with textContent or as attribute values, never as HTML.
"use strict";

(() => {
  const PAGES = ["search", "health", "versions", "duplicates"];
  const HEALTH_REFRESH_MS = 5000;
  const INFO_REFRESH_MS = 15000;
  const TOKEN_KEY = "simsearch.adminToken";
  const SVG_NS = "http://www.w3.org/2000/svg";
  // A "not like" part's starting weight: the server's default for a negative part
  // (serving.search.checks.NEGATIVE_WEIGHT), shown in the part's weight box and sent with it.
  const NEGATIVE_WEIGHT = 0.2;
  const SOURCES = [
    ["probe", "Probe", "labelled catalog items, queried on a schedule"],
    ["traffic", "Traffic", "queries that carried their label"],
    ["text", "Words", "text queries that carried their label"],
    ["feedback", "Feedback", "relevant / not relevant marks"],
    ["ann", "ANN fidelity", "the index's answer against exact search"],
  ];

  const $ = (id) => document.getElementById(id);

  // ---- DOM helpers ---------------------------------------------------------------------------

  /** An element with attributes and children; strings become text nodes (never parsed). */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svgEl(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setAttrs(node, attrs) {
    if (!attrs) return;
    for (const [name, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.setAttribute("class", value);
      else if (name.startsWith("on") && typeof value === "function") node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
  }

  function clear(node) {
    while (node.firstChild) node.firstChild.remove();
    return node;
  }

  const fmtScore = (v) => (typeof v === "number" ? v.toFixed(3) : "—");
  // A percentage to one decimal, but never 100.0% for a figure short of 1: 0.9995 is 99.95%, not
  // what an exact index measures. Digits are added until it reads below 100, then it is cut.
  function fmtPct(v) {
    if (typeof v !== "number" || !Number.isFinite(v)) return "—";
    for (let digits = 1; digits <= 3; digits += 1) {
      const text = (v * 100).toFixed(digits);
      if (v >= 1 || Number(text) < 100) return `${text}%`;
    }
    return "99.999%";
  }
  const fmtMs = (v) =>
    typeof v === "number" && Number.isFinite(v) ? `${v < 10 ? v.toFixed(1) : Math.round(v)} ms` : "—";
  const fmtInt = (v) => (v === undefined || v === null || v === "" ? "—" : Number(v).toLocaleString("en-US"));
  const thumbUrl = (id) => `/v1/items/${encodeURIComponent(id)}/thumbnail`;

  function fmtTime(value) {
    if (!value) return "—";
    const d = typeof value === "number" ? new Date(value * 1000) : new Date(value);
    if (Number.isNaN(d.getTime())) return String(value);
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}`;
  }

  /** A thumbnail <img> that turns into a grey placeholder if the item has no image any more. */
  function thumb(id, extraClass) {
    const img = el("img", { src: thumbUrl(id), alt: "", loading: "lazy", decoding: "async", class: extraClass || "" });
    img.addEventListener("error", () => img.classList.add("missing"), { once: true });
    return img;
  }

  // ---- API -----------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
    toString() {
      return `${this.code}: ${this.message}`;
    }
  }

  const admin = {
    memory: null,
    get() {
      try {
        return sessionStorage.getItem(TOKEN_KEY) || this.memory;
      } catch {
        return this.memory;
      }
    },
    set(token) {
      this.memory = token || null;
      try {
        if (token) sessionStorage.setItem(TOKEN_KEY, token);
        else sessionStorage.removeItem(TOKEN_KEY);
      } catch {
        /* storage off: kept in memory for this page only */
      }
      document.body.classList.toggle("has-admin", Boolean(token));
    },
  };

  /**
   * Call the API. `json`: a body sent as JSON; `body`: sent as is; `admin`: send the admin token
   * in the Authorization header (never a cookie). Errors become ApiError with the server's
   * `{"error": {"code", "message"}}`.
   */
  async function api(path, options = {}) {
    const headers = new Headers(options.headers || {});
    let body = options.body;
    if (options.json !== undefined) {
      headers.set("Content-Type", "application/json");
      body = JSON.stringify(options.json);
    }
    if (options.admin) {
      const token = admin.get();
      if (!token) throw new ApiError(401, "UNAUTHENTICATED", "this needs the admin token: open Admin at the top");
      headers.set("Authorization", `Bearer ${token}`);
    }
    let response;
    try {
      response = await fetch(path, {
        method: options.method || (body !== undefined ? "POST" : "GET"),
        headers,
        body,
        cache: "no-store",
        credentials: "omit",
      });
    } catch (err) {
      throw new ApiError(0, "UNAVAILABLE", `the server did not answer (${err.message})`);
    }
    if (!response.ok) {
      let code = `HTTP ${response.status}`;
      let message = response.statusText || "request failed";
      try {
        const payload = await response.json();
        if (payload && payload.error) {
          code = payload.error.code || code;
          message = payload.error.message || message;
        }
      } catch {
        /* not JSON: keep the status line */
      }
      throw new ApiError(response.status, code, message);
    }
    return options.blob ? response.blob() : response.json();
  }

  // ---- banner --------------------------------------------------------------------------------

  function showError(err, where) {
    const text = err instanceof ApiError ? err.toString() : String(err && err.message ? err.message : err);
    $("banner-text").textContent = where ? `${where}: ${text}` : text;
    $("banner").hidden = false;
  }

  function hideBanner() {
    $("banner").hidden = true;
  }

  // ---- live info (header) --------------------------------------------------------------------

  const state = {
    info: null,
    page: null,
    query: null, // {kind: "image", blob, name} | {kind: "item", id, label} | {kind: "text", text}
    words: null, // words added to an image query as a second part ("like this photo, but red")
    parts: [], // more parts of the query: {id, negative, weight} — "more like this" / "less like this"
    region: null, // {x, y, width, height} in pixels of the upright query image
    regionMode: false,
    previewUrl: null,
    response: null,
    marks: new Map(), // requestId -> Map(id -> true | false)
    filterKey: "",
    healthTimer: null,
    neighboursUrl: null,
    confirmVersion: null,
  };

  async function loadInfo() {
    try {
      const info = await api("/v1/info");
      state.info = info;
      $("live-dot").className = "live-dot ok";
      $("live-text").textContent = `${info.indexVersion || "?"} · ${fmtInt(info.indexSize || 0)} items`;
      $("live").setAttribute(
        "title",
        `live index version ${info.indexVersion}, model ${info.modelId}, ${info.factory}`,
      );
      const maxK = info.limits && info.limits.maxK;
      if (maxK) $("k").max = String(maxK);
      buildFilters(info.filterable || []);
      buildGrouping(info);
      // Words are answered only by a version with a text model (GetInfo's textModelId).
      $("text-form").hidden = !info.textModelId;
      if (info.textContextLength) $("text-query").title = `at most ${info.textContextLength} tokens`;
      return info;
    } catch (err) {
      $("live-dot").className = "live-dot down";
      $("live-text").textContent = "server unreachable";
      $("live").setAttribute("title", String(err));
      return null;
    }
  }

  // ---- routing -------------------------------------------------------------------------------

  function route() {
    const wanted = location.hash.replace(/^#/, "");
    const page = PAGES.includes(wanted) ? wanted : "search";
    if (page === state.page) return;
    state.page = page;
    for (const section of document.querySelectorAll("section.page")) section.hidden = section.dataset.page !== page;
    for (const link of document.querySelectorAll(".nav a")) {
      if (link.dataset.page === page) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    document.title = `${page[0].toUpperCase()}${page.slice(1)} · simsearch console`;
    hideBanner();
    stopHealth();
    if (page === "health") startHealth();
    else if (page === "versions") loadVersions();
    else if (page === "duplicates") loadDuplicatesPage();
  }

  // ---- search page ---------------------------------------------------------------------------

  function buildFilters(fields) {
    const key = JSON.stringify(fields);
    if (key === state.filterKey) return;
    state.filterKey = key;
    const box = clear($("filter-fields"));
    $("filters").hidden = fields.length === 0;
    for (const field of fields) {
      const name = field.name;
      const id = `filter-${name.replace(/[^A-Za-z0-9_-]/g, "_")}`;
      if (field.type === "float" || field.type === "int") {
        const step = field.type === "int" ? "1" : "any";
        box.append(
          el(
            "div",
            { class: "control-row filter-range", "data-field": name, "data-type": field.type },
            el("label", { for: `${id}-min` }, name),
            el("input", {
              type: "number",
              id: `${id}-min`,
              step,
              placeholder: "min",
              "aria-label": `${name} at least`,
              "data-bound": "gte",
            }),
            el("span", { class: "range-dash" }, "–"),
            el("input", {
              type: "number",
              id: `${id}-max`,
              step,
              placeholder: "max",
              "aria-label": `${name} at most`,
              "data-bound": "lte",
            }),
          ),
        );
      } else {
        box.append(
          el(
            "div",
            { class: "control-row filter-value", "data-field": name, "data-type": field.type },
            el("label", { for: id }, name),
            el("input", {
              type: "text",
              id,
              placeholder: "any (a, b: one of)",
              autocomplete: "off",
              spellcheck: "false",
            }),
          ),
        );
      }
    }
  }

  /** The filter the controls describe, as proto3 JSON, or null when none is set. */
  function currentFilter() {
    const must = [];
    for (const row of document.querySelectorAll("#filter-fields [data-field]")) {
      const field = row.dataset.field;
      if (row.classList.contains("filter-range")) {
        const range = {};
        for (const input of row.querySelectorAll("input")) {
          if (input.value.trim() !== "") range[input.dataset.bound] = Number(input.value);
        }
        if (Object.keys(range).length) must.push({ field, range });
      } else {
        const raw = row.querySelector("input").value.trim();
        if (!raw) continue;
        const values = raw
          .split(",")
          .map((v) => v.trim())
          .filter(Boolean);
        if (values.length > 1) must.push({ field, anyOf: { values } });
        else if (values.length === 1) must.push({ field, value: values[0] });
      }
    }
    return must.length ? { must } : null;
  }

  function searchOptions() {
    const k = parseInt($("k").value, 10);
    const options = { k: Number.isFinite(k) ? k : 10 };
    const minScore = $("min-score").value.trim();
    if (minScore !== "") options.minScore = Number(minScore);
    const filter = currentFilter();
    if (filter) options.filter = filter;
    if (!$("group-row").hidden) {
      options.groupBy = $("group-by").value;
      const perGroup = parseInt($("per-group").value, 10);
      if (options.groupBy && Number.isFinite(perGroup) && perGroup > 1) options.perGroup = perGroup;
    }
    return options;
  }

  /** Group-by choices: none, or any declared field; the index's item field first and chosen. */
  function buildGrouping(info) {
    const fields = (info.filterable || []).map((f) => f.name);
    const key = JSON.stringify([fields, info.itemField || ""]);
    if (key === state.groupKey) return;
    state.groupKey = key;
    const select = clear($("group-by"));
    select.append(el("option", { value: "" }, "none (image by image)"));
    for (const name of fields) select.append(el("option", { value: name }, name === info.itemField ? `${name} (item)` : name));
    select.value = info.itemField || "";
    $("group-row").hidden = fields.length === 0;
    const maxPerGroup = info.limits && info.limits.maxPerGroup;
    if (maxPerGroup) $("per-group").max = String(maxPerGroup);
    showPerGroup();
  }

  function showPerGroup() {
    $("per-group-row").hidden = $("group-row").hidden || !$("group-by").value;
  }

  // ---- query parts and regions ------------------------------------------------------------------

  function renderParts() {
    const box = clear($("query-parts"));
    box.hidden = state.parts.length === 0;
    state.parts.forEach((part, i) => {
      const remove = el(
        "button",
        { type: "button", class: "link part-remove", "aria-label": `Remove ${part.id} from the query` },
        "✕",
      );
      remove.addEventListener("click", () => {
        state.parts.splice(i, 1);
        renderParts();
        runSearch();
      });
      // How hard the part pulls (or, "not like", pushes): Rocchio's weight, sent with the query.
      const weight = el("input", {
        type: "number",
        class: "part-weight",
        min: "0.05",
        max: "10",
        step: "0.05",
        value: String(part.weight),
        title: part.negative ? "How hard this pushes the query away (default 0.2)" : "How hard this pulls (default 1)",
        "aria-label": `Weight of ${part.id}`,
      });
      weight.addEventListener("change", () => {
        const value = Number(weight.value);
        if (!(value > 0)) {
          weight.value = String(part.weight);
          return;
        }
        part.weight = value;
        runSearch();
      });
      box.append(
        el(
          "span",
          { class: `part ${part.negative ? "part-negative" : "part-positive"}`, "data-id": part.id },
          `${part.negative ? "− not like" : "+ like"} ${part.id}`,
          weight,
          remove,
        ),
      );
    });
  }

  /** A new query starts alone: no parts, no region (a region needs an image query). */
  function resetParts(imageQuery) {
    state.words = null;
    $("text-with-image-row").hidden = !imageQuery || $("text-form").hidden;
    state.parts = [];
    state.region = null;
    renderParts();
    setRegionMode(false);
    $("region-tools").hidden = !imageQuery;
    drawRegion();
  }

  function addPart(id, negative) {
    if (!state.query) return;
    state.parts = state.parts.filter((p) => p.id !== id);
    state.parts.push({ id, negative, weight: negative ? NEGATIVE_WEIGHT : 1 });
    renderParts();
    runSearch();
  }

  function setRegionMode(on) {
    state.regionMode = on;
    $("region-button").setAttribute("aria-pressed", String(on));
    $("region-button").textContent = on ? "Drag over the image…" : "Select a region";
    $("dropzone").classList.toggle("selecting", on);
  }

  /** Where the picture sits inside the preview element (object-fit: contain letterboxes it). */
  function pictureRect() {
    const img = $("query-preview");
    const box = img.getBoundingClientRect();
    const scale = Math.min(box.width / img.naturalWidth, box.height / img.naturalHeight);
    const width = img.naturalWidth * scale;
    const height = img.naturalHeight * scale;
    return { left: box.left + (box.width - width) / 2, top: box.top + (box.height - height) / 2, width, height, scale };
  }

  function drawRegion() {
    const box = $("region-box");
    const region = state.region;
    const img = $("query-preview");
    if (!region || img.hidden || !img.naturalWidth) {
      box.hidden = true;
      $("region-clear").hidden = true;
      $("region-text").textContent = "";
      return;
    }
    const pic = pictureRect();
    const dropzone = $("dropzone");
    const zone = dropzone.getBoundingClientRect();
    // The box is placed inside the dropzone's border (its padding box): offset by the border.
    box.style.left = `${pic.left - zone.left - dropzone.clientLeft + region.x * pic.scale}px`;
    box.style.top = `${pic.top - zone.top - dropzone.clientTop + region.y * pic.scale}px`;
    box.style.width = `${region.width * pic.scale}px`;
    box.style.height = `${region.height * pic.scale}px`;
    box.hidden = false;
    $("region-clear").hidden = false;
    $("region-text").textContent = `region ${region.x},${region.y} ${region.width}×${region.height} px`;
  }

  function initRegion() {
    const img = $("query-preview");
    const zone = $("dropzone");
    let start = null;
    const toPixels = (e) => {
      const pic = pictureRect();
      const x = Math.min(Math.max((e.clientX - pic.left) / pic.scale, 0), img.naturalWidth);
      const y = Math.min(Math.max((e.clientY - pic.top) / pic.scale, 0), img.naturalHeight);
      return { x, y };
    };
    const regionOf = (a, b) => ({
      x: Math.round(Math.min(a.x, b.x)),
      y: Math.round(Math.min(a.y, b.y)),
      width: Math.round(Math.abs(a.x - b.x)),
      height: Math.round(Math.abs(a.y - b.y)),
    });
    zone.addEventListener("pointerdown", (e) => {
      if (!state.regionMode || img.hidden) return;
      e.preventDefault();
      start = toPixels(e);
      zone.setPointerCapture(e.pointerId);
    });
    zone.addEventListener("pointermove", (e) => {
      if (!start) return;
      state.region = regionOf(start, toPixels(e));
      drawRegion();
    });
    zone.addEventListener("pointerup", (e) => {
      if (!start) return;
      const region = regionOf(start, toPixels(e));
      start = null;
      zone.releasePointerCapture(e.pointerId);
      setRegionMode(false);
      if (region.width < 8 || region.height < 8) {
        state.region = null;
        drawRegion();
        showError("drag a larger region: at least 8 pixels a side", "region");
        return;
      }
      state.region = region;
      drawRegion();
      runSearch();
    });
    // A drag that ends over the label must not open the file chooser.
    zone.addEventListener("click", (e) => {
      if (state.regionMode || zone.classList.contains("selecting")) e.preventDefault();
    });
    $("region-button").addEventListener("click", () => setRegionMode(!state.regionMode));
    $("region-clear").addEventListener("click", () => {
      state.region = null;
      drawRegion();
      runSearch();
    });
    // Redrawn whenever the picture's frame changes size, not only on the window's resize event:
    // a resize while another page shows (the search page hidden, its boxes 0×0), a scrollbar or
    // the layout moving the frame — the box would stay where the old layout put it.
    if (window.ResizeObserver) {
      const observer = new ResizeObserver(() => drawRegion());
      observer.observe(zone);
      observer.observe(img);
    }
    window.addEventListener("resize", () => drawRegion());
    img.addEventListener("load", () => drawRegion());
  }

  function base64Of(blob) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result).replace(/^data:[^,]*,/, ""));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(blob);
    });
  }

  /** The query as parts: the image (its region) or item, then the "like" / "not like" items. */
  async function queryParts(query) {
    const first =
      query.kind === "image"
        ? { image: await base64Of(query.blob), ...(state.region ? { region: state.region } : {}) }
        : query.kind === "text"
          ? { text: query.text }
          : { itemId: query.id };
    return [
      first,
      ...(state.words ? [{ text: state.words }] : []),
      ...state.parts.map((p) => ({ itemId: p.id, weight: p.weight, ...(p.negative ? { negative: true } : {}) })),
    ];
  }

  function setQueryImage(blob, name) {
    if (!blob) return;
    if (blob.type && !blob.type.startsWith("image/")) {
      showError(`${name || "that file"} is not an image (${blob.type})`);
      return;
    }
    state.query = { kind: "image", blob, name: name || "pasted image" };
    resetParts(true);
    $("item-id").value = "";
    showQueryPreview(URL.createObjectURL(blob), true);
    $("query-caption").textContent = `${state.query.name}${blob.size ? ` · ${(blob.size / 1024).toFixed(1)} kB` : ""}`;
    runSearch();
  }

  function setQueryText(text) {
    if (state.query && state.query.kind === "image" && $("text-with-image").checked) {
      state.words = text; // the image stays the query; the words are its second part
      $("query-caption").textContent = `${state.query.name} + “${text}”`;
      runSearch();
      return;
    }
    state.query = { kind: "text", text };
    resetParts(false);
    $("item-id").value = "";
    if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
    state.previewUrl = null;
    $("query-preview").hidden = true;
    $("query-preview").removeAttribute("src");
    $("dropzone-empty").hidden = false;
    $("dropzone").classList.remove("has-image");
    $("query-caption").textContent = `“${text}”`;
    runSearch();
  }

  function setQueryItem(id, label) {
    state.query = { kind: "item", id, label };
    resetParts(false);
    $("item-id").value = id;
    showQueryPreview(thumbUrl(id), false);
    $("query-caption").textContent = label ? `item ${id} · ${label}` : `item ${id}`;
    runSearch();
  }

  function showQueryPreview(url, owned) {
    if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
    state.previewUrl = owned ? url : null;
    const img = $("query-preview");
    img.classList.remove("missing");
    img.src = url;
    img.hidden = false;
    $("dropzone-empty").hidden = true;
    $("dropzone").classList.add("has-image");
  }

  function clearQuery() {
    if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
    state.previewUrl = null;
    state.query = null;
    state.response = null;
    resetParts(false);
    $("query-preview").hidden = true;
    $("query-preview").removeAttribute("src");
    $("dropzone-empty").hidden = false;
    $("dropzone").classList.remove("has-image");
    $("query-caption").textContent = "";
    $("item-id").value = "";
    $("text-query").value = "";
    $("file-input").value = "";
    clear($("results-grid"));
    $("timings").textContent = "";
    $("search-status").textContent = "Drop, paste or choose an image to find its neighbours.";
  }

  let searchSerial = 0;

  async function runSearch() {
    const query = state.query;
    if (!query) {
      $("search-status").textContent = "Choose an image or an item id first.";
      return;
    }
    const serial = ++searchSerial;
    const options = searchOptions();
    const grid = $("results-grid");
    grid.classList.add("loading");
    $("search-status").textContent = "Searching…";
    hideBanner();
    const started = performance.now();
    try {
      let response;
      if (state.parts.length || state.words) {
        response = await api("/v1/search", { json: { parts: await queryParts(query), ...options } });
      } else if (query.kind === "text") {
        response = await api("/v1/search", { json: { text: query.text, ...options } });
      } else if (query.kind === "image") {
        const params = new URLSearchParams({ k: String(options.k) });
        if (options.minScore !== undefined) params.set("minScore", String(options.minScore));
        if (options.filter) params.set("filter", JSON.stringify(options.filter));
        if (options.groupBy !== undefined) params.set("groupBy", options.groupBy);
        if (options.perGroup) params.set("perGroup", String(options.perGroup));
        const r = state.region;
        if (r) params.set("region", `${r.x},${r.y},${r.width},${r.height}`);
        response = await api(`/v1/search/image?${params}`, {
          method: "POST",
          body: query.blob,
          headers: { "Content-Type": query.blob.type || "application/octet-stream" },
        });
      } else {
        response = await api("/v1/search", { json: { itemId: query.id, ...options } });
      }
      if (serial !== searchSerial) return; // a newer search has started
      const elapsed = performance.now() - started;
      state.response = response;
      renderResults(response, elapsed);
    } catch (err) {
      if (serial !== searchSerial) return;
      clear(grid);
      $("timings").textContent = "";
      $("search-status").textContent = "The search failed.";
      showError(err, "search");
    } finally {
      if (serial === searchSerial) grid.classList.remove("loading");
    }
  }

  function renderResults(response, elapsed) {
    const neighbors = response.neighbors || [];
    const grid = clear($("results-grid"));
    const groups = response.groupBy ? new Set(neighbors.map((n) => n.group)).size : 0;
    const count = response.groupBy
      ? `${groups} ${response.groupBy} group${groups === 1 ? "" : "s"} (${neighbors.length} images)`
      : `${neighbors.length} neighbour${neighbors.length === 1 ? "" : "s"}`;
    const notes = [];
    if (response.truncated) notes.push("more qualify than shown");
    $("search-status").textContent = neighbors.length
      ? `${count}${notes.length ? ` (${notes.join(", ")})` : ""} · version ${response.indexVersion || "?"}`
      : "No neighbours match: loosen the filter or the min score.";
    const t = response.timings || {};
    const parts = [
      ["decode", t.decodeMs],
      ["queue", t.queueMs],
      ["embed", t.embedMs],
      ["search", t.searchMs],
    ]
      .filter(([, v]) => typeof v === "number" && v > 0)
      .map(([name, v]) => `${name} ${fmtMs(v)}`);
    $("timings").textContent =
      `${fmtMs(elapsed)} round trip · server ${fmtMs(t.totalMs || 0)}${parts.length ? ` (${parts.join(", ")})` : ""}`;
    const marks = state.marks.get(response.requestId) || new Map();
    let rank = 0;
    neighbors.forEach((n, i) => {
      const first = !response.groupBy || i === 0 || neighbors[i - 1].group !== n.group;
      if (first) rank += 1;
      grid.append(resultCard(n, rank - 1, response.requestId, marks, response.groupBy ? n.group : null, first));
    });
    grid.dataset.requestId = response.requestId || "";
  }

  function resultCard(n, index, requestId, marks, group, firstOfGroup) {
    const id = n.id;
    const label = n.label || "";
    const meta = Object.entries(n.metadata || {})
      .slice(0, 3)
      .map(([key, value]) => `${key}: ${value}`)
      .join(" · ");
    const yes = el(
      "button",
      {
        type: "button",
        class: "mark mark-yes",
        title: "Relevant to the query",
        "aria-label": `${id} is relevant`,
        "aria-pressed": "false",
      },
      "✓ Yes",
    );
    const no = el(
      "button",
      {
        type: "button",
        class: "mark mark-no",
        title: "Not relevant to the query",
        "aria-label": `${id} is not relevant`,
        "aria-pressed": "false",
      },
      "✗ No",
    );
    const like = el(
      "button",
      { type: "button", class: "secondary like", title: `Add ${id} to the query`, "aria-label": `More like ${id}` },
      "+ like",
    );
    const unlike = el(
      "button",
      { type: "button", class: "secondary unlike", title: `Search away from ${id}`, "aria-label": `Less like ${id}` },
      "− not like",
    );
    const card = el(
      "article",
      {
        class: `card${group !== null && !firstOfGroup ? " card-same-group" : ""}`,
        "data-id": id,
        "data-rank": index + 1,
        ...(group !== null ? { "data-group": group } : {}),
      },
      el(
        "button",
        { type: "button", class: "thumb by-this-thumb", title: `Search by ${id}`, "aria-label": `Search by ${id}` },
        thumb(id),
        el("span", { class: "rank" }, `#${index + 1}`),
      ),
      el(
        "div",
        { class: "card-body" },
        el(
          "div",
          { class: "card-line" },
          el("span", { class: "score", title: "cosine similarity" }, fmtScore(n.score)),
          el("span", { class: "card-label", title: label }, label),
        ),
        el("div", { class: "card-id", title: id }, id),
        group !== null ? el("div", { class: "card-group", title: `group ${group}` }, `◆ ${group}`) : null,
        meta ? el("div", { class: "card-meta", title: meta }, meta) : null,
        el("button", { type: "button", class: "by-this secondary" }, "Search by this"),
        el("div", { class: "part-buttons" }, like, unlike),
        el("div", { class: "marks" }, el("span", { class: "marks-label" }, "Relevant?"), yes, no),
      ),
    );
    const search = () => {
      setQueryItem(id, label);
      window.scrollTo({ top: 0, behavior: "smooth" });
    };
    card.querySelector(".by-this-thumb").addEventListener("click", search);
    card.querySelector(".by-this").addEventListener("click", search);
    like.addEventListener("click", () => addPart(id, false));
    unlike.addEventListener("click", () => addPart(id, true));
    const paint = () => {
      const mark = marks.get(id);
      yes.setAttribute("aria-pressed", String(mark === true));
      no.setAttribute("aria-pressed", String(mark === false));
      card.classList.toggle("marked-yes", mark === true);
      card.classList.toggle("marked-no", mark === false);
    };
    yes.addEventListener("click", () => sendMark(requestId, marks, id, true, paint));
    no.addEventListener("click", () => sendMark(requestId, marks, id, false, paint));
    paint();
    return card;
  }

  /** One mark → one Feedback call naming every result marked relevant in this answer so far
   * (none: the answer counts as a miss). */
  async function sendMark(requestId, marks, id, relevant, paint) {
    if (!requestId) return;
    marks.set(id, relevant);
    state.marks.set(requestId, marks);
    paint();
    const relevantIds = [...marks].filter(([, v]) => v).map(([k]) => k);
    try {
      const answer = await api("/v1/feedback", { json: { requestId, relevantIds } });
      $("search-status").textContent = answer.accepted
        ? `Feedback recorded: ${relevant ? "relevant" : "not relevant"} — ${id}`
        : "Feedback not counted: the live index changed since this answer.";
    } catch (err) {
      showError(err, "feedback");
    }
  }

  function initSearch() {
    const drop = $("dropzone");
    $("file-input").addEventListener("change", (e) => {
      const file = e.target.files && e.target.files[0];
      if (file) setQueryImage(file, file.name);
    });
    for (const type of ["dragenter", "dragover"]) {
      drop.addEventListener(type, (e) => {
        e.preventDefault();
        drop.classList.add("dragging");
      });
    }
    for (const type of ["dragleave", "dragend"]) drop.addEventListener(type, () => drop.classList.remove("dragging"));
    drop.addEventListener("drop", (e) => {
      e.preventDefault();
      drop.classList.remove("dragging");
      const file = [...(e.dataTransfer ? e.dataTransfer.files : [])].find((f) => f.type.startsWith("image/"));
      if (file) setQueryImage(file, file.name);
      else showError("drop an image file (PNG, JPEG, WebP, …)");
    });
    drop.addEventListener("keydown", (e) => {
      if (e.key === "Enter" || e.key === " ") {
        e.preventDefault();
        $("file-input").click();
      }
    });
    // Stop a drop that misses the zone from opening the image in place of the console.
    window.addEventListener("dragover", (e) => e.preventDefault());
    window.addEventListener("drop", (e) => e.preventDefault());
    document.addEventListener("paste", (e) => {
      const items = e.clipboardData ? [...e.clipboardData.items] : [];
      const item = items.find((i) => i.kind === "file" && i.type.startsWith("image/"));
      if (!item) return;
      e.preventDefault();
      if (state.page !== "search") location.hash = "#search";
      setQueryImage(item.getAsFile(), "pasted image");
    });
    $("item-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const id = $("item-id").value.trim();
      if (id) setQueryItem(id, "");
    });
    $("text-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("text-query").value.trim();
      if (text) setQueryText(text);
    });
    $("search-form").addEventListener("submit", (e) => {
      e.preventDefault();
      runSearch();
    });
    $("clear-button").addEventListener("click", clearQuery);
    $("group-by").addEventListener("change", () => {
      showPerGroup();
      if (state.query) runSearch();
    });
    initRegion();
  }

  // ---- health page ---------------------------------------------------------------------------

  function startHealth() {
    refreshHealth();
    state.healthTimer = setInterval(refreshHealth, HEALTH_REFRESH_MS);
  }

  function stopHealth() {
    if (state.healthTimer) clearInterval(state.healthTimer);
    state.healthTimer = null;
  }

  async function refreshHealth() {
    const [history, info] = await Promise.allSettled([api("/v1/health/history"), loadInfo()]);
    if (state.page !== "health") return;
    const h = history.status === "fulfilled" ? history.value : null;
    const i = info.status === "fulfilled" ? info.value : null;
    if (!h && history.reason) showError(history.reason, "health history");
    renderLiveCards(h, i);
    renderRecall(recallBySource(h, i), samplesBySource(h, i));
    const points = (h && h.points) || [];
    const now = Date.now() / 1000;
    const interval = (h && h.intervalS) || 10;
    drawChart($("chart-qps"), points, [{ key: "qps", cls: "line-qps", label: "q/s" }], now, interval);
    drawChart(
      $("chart-latency"),
      points,
      [
        { key: "p50Ms", cls: "line-p50", label: "p50" },
        { key: "p99Ms", cls: "line-p99", label: "p99" },
      ],
      now,
      interval,
    );
    $("health-updated").textContent =
      `updated ${new Date().toLocaleTimeString()} · every ${HEALTH_REFRESH_MS / 1000} s`;
  }

  /** {source: {k: value}}: GetInfo's figures (what the gRPC GetInfo says), else the history's. */
  function recallBySource(history, info) {
    const out = {};
    if (info) {
      for (const f of [...(info.recallAtK || []), ...(info.annRecallAtK || [])]) {
        (out[f.source] = out[f.source] || {})[f.k] = f.value;
      }
    }
    if (history && history.recall) {
      for (const [source, values] of Object.entries(history.recall)) {
        if (!out[source] && values) out[source] = { ...values };
      }
    }
    return out;
  }

  /** {source: {k: n}}: what each figure is a mean over (answers, probe queries, exact re-runs). */
  function samplesBySource(history, info) {
    const out = {};
    if (info) {
      for (const f of [...(info.recallAtK || []), ...(info.annRecallAtK || [])]) {
        (out[f.source] = out[f.source] || {})[f.k] = f.samples || 0;
      }
    }
    if (history && history.samples) {
      for (const [source, counts] of Object.entries(history.samples)) {
        if (!out[source] && counts) out[source] = { ...counts };
      }
    }
    return out;
  }

  function renderLiveCards(history, info) {
    const live = (history && history.live) || {};
    const points = (history && history.points) || [];
    const last = points.length ? points[points.length - 1] : {};
    const cards = [
      ["Live version", (info && info.indexVersion) || live.indexVersion, "wide"],
      ["Model", (info && info.modelId) || live.modelId],
      ["Items", fmtInt((info && info.indexSize) ?? live.indexSize)],
      ["Index", (info && info.factory) || live.factory],
      ["Queries / s", typeof last.qps === "number" ? last.qps.toFixed(1) : "—"],
      ["p50 · p99", `${fmtMs(last.p50Ms)} · ${fmtMs(last.p99Ms)}`],
    ];
    const box = clear($("health-live"));
    for (const [name, value, wide] of cards) {
      box.append(
        el(
          "div",
          { class: wide ? "stat wide" : "stat" },
          el("div", { class: "stat-name" }, name),
          el("div", { class: "stat-value", title: value || "" }, value || "—"),
        ),
      );
    }
  }

  function renderRecall(bySource, samples) {
    const ks = new Set();
    for (const values of Object.values(bySource)) for (const k of Object.keys(values)) ks.add(Number(k));
    const sorted = [...ks].sort((a, b) => a - b);
    const table = clear($("recall-table"));
    if (!sorted.length) {
      table.append(
        el(
          "tbody",
          null,
          el(
            "tr",
            null,
            el(
              "td",
              { class: "muted" },
              "No Recall@K measured yet: probe rounds, labelled queries or feedback fill it in.",
            ),
          ),
        ),
      );
      return;
    }
    table.append(
      el(
        "thead",
        null,
        el(
          "tr",
          null,
          el("th", { scope: "col" }, "Source"),
          sorted.map((k) => el("th", { scope: "col", class: "num" }, `R@${k}`)),
        ),
      ),
    );
    const body = el("tbody");
    for (const [source, name, about] of SOURCES) {
      const values = bySource[source] || {};
      body.append(
        el(
          "tr",
          { "data-source": source },
          el("th", { scope: "row" }, el("div", null, name), el("div", { class: "muted small" }, about)),
          sorted.map((k) => {
            const v = values[k];
            if (typeof v !== "number") return el("td", { class: "num muted", "data-k": k }, "—");
            return el(
              "td",
              { class: "num", "data-k": k, "data-value": v },
              el("div", null, fmtPct(v)),
              el("div", { class: "muted small", "data-samples": (samples[source] || {})[k] ?? "" }, `n = ${fmtInt((samples[source] || {})[k] ?? 0)}`),
              el("meter", {
                min: "0",
                max: "1",
                low: "0.8",
                high: "0.95",
                optimum: "1",
                value: String(v),
                "aria-label": `${name} recall at ${k}`,
              }),
            );
          }),
        ),
      );
    }
    table.append(body);
  }

  /** A small line chart over the last hour, built as SVG nodes. */
  function drawChart(box, points, series, now, interval) {
    const W = 560;
    const H = 170;
    const pad = { l: 40, r: 10, t: 10, b: 22 };
    // The last hour, or since the first interval when the server is younger than that.
    const first = points.length ? Math.min(...points.map((p) => p.t)) - interval : now - 3600;
    const t0 = Math.max(now - 3600, Math.min(first, now - 60));
    const span = now - t0;
    let top = 0;
    for (const p of points) for (const s of series) if (typeof p[s.key] === "number") top = Math.max(top, p[s.key]);
    const step = niceStep(top > 0 ? (top * 1.05) / 4 : 0.25);
    const max = step * 4;
    const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    const x = (t) => pad.l + ((t - t0) / span) * (W - pad.l - pad.r);
    const y = (v) => H - pad.b - (v / max) * (H - pad.t - pad.b);
    const root = svgEl("svg", {
      viewBox: `0 0 ${W} ${H}`,
      class: "chart-svg",
      role: "img",
      "aria-label": series.map((s) => s.label).join(", "),
    });
    for (let i = 0; i <= 4; i++) {
      const v = (max * i) / 4;
      root.append(svgEl("line", { x1: pad.l, x2: W - pad.r, y1: y(v), y2: y(v), class: "grid-line" }));
      root.append(svgEl("text", { x: pad.l - 6, y: y(v) + 4, class: "tick tick-y" }, v.toFixed(Math.min(decimals, 3))));
    }
    const tickStep = [10, 15, 30, 60, 120, 300, 600, 900].find((s) => span / s <= 5) || 900;
    for (let ago = 0; ago <= span + 1e-6; ago += tickStep) {
      const text = ago === 0 ? "now" : ago < 60 ? `−${ago} s` : `−${ago / 60} min`;
      root.append(svgEl("text", { x: x(now - ago), y: H - 6, class: "tick tick-x" }, text));
    }
    const recent = points.filter((p) => p.t >= t0);
    if (!recent.length) {
      root.append(svgEl("text", { x: W / 2, y: H / 2, class: "chart-empty" }, "no traffic in the last hour"));
    }
    for (const s of series) {
      // A line through consecutive intervals that have the figure; an interval without it (no
      // calls: no latency) breaks the line, and a lone interval is a dot.
      let run = [];
      const flush = () => {
        if (run.length === 1)
          root.append(svgEl("circle", { cx: run[0][0], cy: run[0][1], r: 2.5, class: `dot ${s.cls}` }));
        else if (run.length > 1)
          root.append(svgEl("polyline", { points: run.map((c) => c.join(",")).join(" "), class: `series ${s.cls}` }));
        run = [];
      };
      for (const p of recent) {
        if (typeof p[s.key] === "number") run.push([x(p.t).toFixed(1), y(p[s.key]).toFixed(1)]);
        else flush();
      }
      flush();
    }
    clear(box).append(root);
  }

  /** The least of 1, 2, 5 × 10^n at or above v: a grid step whose ticks print short. */
  function niceStep(v) {
    const exp = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 5, 10]) if (m * exp >= v * (1 - 1e-9)) return m * exp;
    return 10 * exp;
  }

  // ---- versions page -------------------------------------------------------------------------

  async function loadVersions(message) {
    const table = clear($("versions-table"));
    $("versions-status").textContent = message || "";
    if (!admin.get()) return;
    try {
      const [listing] = await Promise.all([api("/v1/admin/versions", { admin: true }), loadInfo()]);
      renderVersions(listing.versions || []);
      if (!message) $("versions-status").textContent = `${(listing.versions || []).length} versions`;
    } catch (err) {
      table.append(el("tbody", null, el("tr", null, el("td", { class: "muted" }, "Could not list the versions."))));
      showError(err, "versions");
    }
  }

  function renderVersions(versions) {
    const ks = new Set();
    for (const v of versions) for (const k of Object.keys(v.probeRecallAtK || {})) ks.add(Number(k));
    const sortedK = [...ks].sort((a, b) => a - b).slice(0, 4);
    const table = clear($("versions-table"));
    const head = (text, num) => el("th", { scope: "col", class: num ? "num" : null }, text);
    table.append(
      el(
        "thead",
        null,
        el(
          "tr",
          null,
          head("Version"),
          head("Items", true),
          head("Index"),
          head("Model"),
          head("ANN recall", true),
          sortedK.map((k) => head(`Probe R@${k}`, true)),
          el("th", { scope: "col" }, el("span", { class: "visually-hidden" }, "Actions")),
        ),
      ),
    );
    const body = el("tbody");
    const ordered = [...versions].sort((a, b) =>
      String(b.created || b.version).localeCompare(String(a.created || a.version)),
    );
    for (const v of ordered) {
      const actions = el("td", { class: "actions" });
      const show = el("button", { type: "button", class: "secondary small-button show-neighbours" }, "Neighbours");
      show.addEventListener("click", () => showNeighbours(v.version));
      actions.append(show);
      if (!v.live) {
        const make = el(
          "button",
          { type: "button", class: "small-button make-live", "data-version": v.version },
          "Make live",
        );
        make.addEventListener("click", () => makeLive(v.version, make));
        actions.append(make);
      }
      const deleted = v.deletedRows ? ` (${fmtInt(v.deletedRows)} deleted rows)` : "";
      const origin = v.parentVersion ? ` · from ${v.parentVersion}` : "";
      body.append(
        el(
          "tr",
          { class: v.live ? "is-live" : null, "data-version": v.version },
          el(
            "td",
            { class: "version-cell" },
            el(
              "div",
              null,
              el("code", { title: v.version }, v.version),
              v.live ? el("span", { class: "badge" }, "live") : null,
            ),
            el("div", { class: "muted small" }, `${fmtTime(v.created)}${origin}`),
            v.error ? el("div", { class: "error-text small" }, v.error) : null,
          ),
          el(
            "td",
            { class: "num", title: `${fmtInt(v.size)} live items${deleted}` },
            fmtInt(v.size),
            v.deletedRows ? el("div", { class: "muted small" }, `−${fmtInt(v.deletedRows)} removed`) : null,
          ),
          el(
            "td",
            null,
            v.factory || "—",
            layout(v) ? el("div", { class: "muted small version-layout" }, layout(v)) : null,
          ),
          el(
            "td",
            null,
            el("code", null, v.modelId || "—"),
            v.textModelId
              ? el("div", { class: "muted small text-model" }, "words: ", el("code", null, v.textModelId))
              : null,
          ),
          el("td", { class: "num" }, fmtPct(v.annRecall)),
          sortedK.map((k) => probeCell(v, k)),
          actions,
        ),
      );
    }
    table.append(body);
    const live = ordered.find((v) => v.live);
    if (live && $("neighbours-figure").hidden) showNeighbours(live.version);
  }

  // How a version's rows lie: its shards and segments (a change writes a segment, compaction merges them).
  function layout(v) {
    const parts = [];
    if (v.shards > 1) parts.push(`${v.shards} shards`);
    if (v.segments) parts.push(`${v.segments} segment${v.segments === 1 ? "" : "s"}`);
    return parts.join(" · ");
  }

  // A version's probe Recall@K, with its 95% interval below it where the build measured one
  // (versions built before it have none): two versions' figures differ only beyond it.
  function probeCell(v, k) {
    const value = (v.probeRecallAtK || {})[k];
    const interval = (v.probeIntervalAtK || {})[k];
    if (!Array.isArray(interval) || typeof value !== "number") return el("td", { class: "num" }, fmtPct(value));
    const queries = typeof v.probeQueries === "number" ? ` of ${fmtInt(v.probeQueries)} queries` : "";
    return el(
      "td",
      { class: "num", title: `95% confidence interval (Wilson)${queries}` },
      fmtPct(value),
      el("div", { class: "muted small probe-interval" }, `${fmtPct(interval[0])}–${fmtPct(interval[1])}`),
    );
  }

  async function showNeighbours(version) {
    const figure = $("neighbours-figure");
    try {
      const blob = await api(`/v1/admin/versions/${encodeURIComponent(version)}/neighbours.png`, {
        admin: true,
        blob: true,
      });
      if (state.neighboursUrl) URL.revokeObjectURL(state.neighboursUrl);
      state.neighboursUrl = URL.createObjectURL(blob);
      $("neighbours-image").src = state.neighboursUrl;
      $("neighbours-caption").textContent =
        `neighbours.png of ${version}: sample queries and their nearest items, green where the label matches`;
      figure.hidden = false;
    } catch (err) {
      figure.hidden = true;
      if (err.status !== 404) showError(err, "neighbours.png");
    }
  }

  async function makeLive(version, button) {
    const restore = $("restore-taken-down").checked;
    if (state.confirmVersion !== version) {
      state.confirmVersion = version;
      // Republishing taken-down items is the rare, deliberate case: the confirm says so.
      button.textContent = restore ? "Confirm: make live, restoring taken-down items" : "Confirm: make live";
      button.classList.add("danger");
      setTimeout(() => {
        if (state.confirmVersion === version && button.isConnected) {
          state.confirmVersion = null;
          button.textContent = "Make live";
          button.classList.remove("danger");
        }
      }, 6000);
      return;
    }
    state.confirmVersion = null;
    button.disabled = true;
    button.textContent = "Loading…";
    try {
      const query = restore ? "?restoreTakenDown=true" : "";
      const answer = await api(`/v1/admin/versions/${encodeURIComponent(version)}/live${query}`, {
        method: "POST",
        admin: true,
      });
      $("restore-taken-down").checked = false;
      const info = await loadInfo();
      const now = info ? info.indexVersion : answer.indexVersion;
      $("neighbours-figure").hidden = true;
      const model = info ? info.modelId : answer.modelId;
      const size = info ? `, ${fmtInt(info.indexSize)} items` : "";
      const reapplied = answer.reappliedIds || [];
      const restored = answer.restoredIds || [];
      let takedowns = "";
      if (reapplied.length)
        takedowns = `; ${reapplied.length} takedowns made since ${version} re-applied (${reapplied.join(", ")})`;
      if (restored.length) takedowns = `; ${restored.length} taken-down items restored (${restored.join(", ")})`;
      await loadVersions(
        `Now live: ${now} (model ${model}${size}), was ${answer.previousIndexVersion || "—"}${takedowns}`,
      );
    } catch (err) {
      button.disabled = false;
      button.textContent = "Make live";
      showError(err, "make live");
    }
  }

  // ---- duplicates and takedowns --------------------------------------------------------------

  async function loadDuplicatesPage(message) {
    await Promise.all([loadDuplicates(), loadAudit()]);
    if (message) $("takedown-result").textContent = message;
  }

  async function loadDuplicates() {
    const box = clear($("duplicate-groups"));
    const status = $("duplicates-status");
    status.textContent = "";
    let answer;
    try {
      answer = await api("/v1/duplicates");
    } catch (err) {
      showError(err, "duplicates");
      return;
    }
    if (answer.run === null) {
      box.append(
        el(
          "p",
          { class: "notice" },
          "No near-duplicate run for the live version yet. Run ",
          el("code", null, "python -m index duplicates --index-root ROOT --min-score 0.9"),
          " and reload this page.",
        ),
      );
      return;
    }
    const groups = answer.groups || [];
    const threshold = typeof answer.minScore === "number" ? ` at cosine ≥ ${answer.minScore}` : "";
    const plural = groups.length === 1 ? "" : "s";
    status.textContent = `${groups.length} group${plural}${threshold} · version ${answer.indexVersion}`;
    if (!groups.length) {
      box.append(el("p", { class: "notice" }, "No near-duplicates at this threshold."));
      return;
    }
    state.groups = groups;
    state.groupsShown = 0;
    showMoreGroups();
  }

  const GROUPS_PAGE = 12; // groups added per "show more"
  const MEMBERS_SHOWN = 12; // members of a group shown before "+N more"

  function showMoreGroups() {
    const box = $("duplicate-groups");
    const old = box.querySelector(".more-groups");
    if (old) old.remove();
    const groups = state.groups || [];
    const next = groups.slice(state.groupsShown, state.groupsShown + GROUPS_PAGE);
    state.groupsShown += next.length;
    for (const g of next) box.append(dupGroup(g));
    const left = groups.length - state.groupsShown;
    if (left > 0) {
      const more = el(
        "button",
        { type: "button", class: "secondary more-groups" },
        `Show ${Math.min(left, GROUPS_PAGE)} more of ${left} groups`,
      );
      more.addEventListener("click", showMoreGroups);
      box.append(more);
    }
  }

  function dupGroup(g) {
    const ids = g.ids || [];
    const labels = g.labels || [];
    const members = el("div", { class: "dup-members" });
    const fill = (count) => {
      clear(members);
      ids.slice(0, count).forEach((id, i) => members.append(dupMember(id, labels[i])));
      const hidden = ids.length - count;
      if (hidden > 0) {
        const more = el("button", { type: "button", class: "dup-more secondary" }, `+${hidden} more`);
        more.addEventListener("click", () => fill(ids.length));
        members.append(more);
      }
    };
    fill(Math.min(ids.length, MEMBERS_SHOWN));
    const distinct = [...new Set(labels.filter(Boolean))];
    return el(
      "section",
      { class: "dup-group", "data-group": g.group },
      el(
        "h3",
        null,
        `Group ${g.group}`,
        el("span", { class: "muted" }, ` · ${g.size ?? ids.length} items`),
        distinct.length
          ? el(
              "span",
              { class: "muted dup-labels", title: distinct.join(", ") },
              ` · ${distinct.length === 1 ? distinct[0] : `${distinct.length} labels`}`,
            )
          : null,
      ),
      members,
    );
  }

  function dupMember(id, label) {
    const title = label ? `${id} · ${label}` : id;
    const tile = [thumb(id), el("span", { class: "dup-id" }, id)];
    if (!admin.get()) return el("div", { class: "dup-member", "data-id": id, title }, tile);
    const box = el("input", { type: "checkbox", class: "dup-select", "aria-label": `Select ${id} for takedown` });
    const member = el("label", { class: "dup-member selectable", "data-id": id, title }, tile, box);
    box.checked = takedownIds().includes(id);
    member.classList.toggle("selected", box.checked);
    box.addEventListener("change", () => {
      member.classList.toggle("selected", box.checked);
      const ids = takedownIds().filter((other) => other !== id);
      if (box.checked) ids.push(id);
      $("takedown-ids").value = ids.join("\n");
    });
    return member;
  }

  /** The ids in the takedown box, one a line (ids may hold commas and spaces, not newlines). */
  function takedownIds() {
    return [
      ...new Set(
        $("takedown-ids")
          .value.split("\n")
          .map((s) => s.trim())
          .filter(Boolean),
      ),
    ];
  }

  async function submitTakedown(e) {
    e.preventDefault();
    const ids = takedownIds();
    const reason = $("takedown-reason").value.trim();
    if (!ids.length) {
      showError("name at least one item id to remove");
      return;
    }
    if (!reason) {
      showError("give a reason: it is kept in the audit log");
      return;
    }
    const button = $("takedown-button");
    button.disabled = true;
    $("takedown-result").textContent = `Removing ${ids.length}…`;
    try {
      const r = await api("/v1/admin/remove-items", { json: { ids, reason }, admin: true });
      const notFound = r.notFound || [];
      $("takedown-ids").value = "";
      $("takedown-reason").value = "";
      await loadInfo();
      const missing = notFound.length ? ` (not found: ${notFound.join(", ")})` : "";
      await loadDuplicatesPage(
        `Removed ${r.removed || 0} of ${ids.length}${missing}. Now serving ${r.indexVersion} ` +
          `with ${fmtInt(r.indexSize)} items; ${r.previousIndexVersion} kept for rollback.`,
      );
    } catch (err) {
      $("takedown-result").textContent = "";
      showError(err, "takedown");
    } finally {
      button.disabled = false;
    }
  }

  async function loadAudit() {
    const list = clear($("audit-list"));
    if (!admin.get()) return;
    let entries;
    try {
      entries = (await api("/v1/admin/audit", { admin: true })).entries || [];
    } catch (err) {
      showError(err, "audit log");
      return;
    }
    if (!entries.length) {
      list.append(el("li", { class: "muted audit-empty" }, "Nothing has been taken down."));
      return;
    }
    const count = (v) => (Array.isArray(v) ? v.length : v);
    const listed = (list) => list.slice(0, 8).join(", ") + (list.length > 8 ? ` +${list.length - 8} more` : "");
    for (const entry of entries) {
      // The server answers newest first. `ids` are the ids the entry removed (or restored);
      // the ids it could not find are `not_found`, named apart.
      const ids = entry.ids || [];
      const shown = listed(ids);
      const removed = count(entry.removed);
      const requested = count(entry.requested) ?? ids.length;
      const missing = Array.isArray(entry.not_found) ? entry.not_found : [];
      const notFound = count(entry.not_found) || 0;
      let line = `${removed ?? "?"} of ${requested} removed: ${shown || "—"}`;
      if (notFound) line += `; ${notFound} not found${missing.length ? `: ${listed(missing)}` : ""}`;
      if (entry.action === "rollback") line = `re-applied ${ids.length} takedowns: ${shown || "—"}`;
      if (entry.action === "restore") line = `restored ${ids.length} taken-down items: ${shown || "—"}`;
      list.append(
        el(
          "li",
          { class: "audit-entry", "data-action": entry.action || "remove" },
          el(
            "div",
            { class: "audit-head" },
            el("span", { class: "audit-time" }, fmtTime(entry.time)),
            el("span", { class: "muted" }, ` · ${entry.who || "?"}${entry.via ? ` via ${entry.via}` : ""}`),
          ),
          el("div", { class: "audit-reason" }, entry.reason || "(no reason given)"),
          el("div", { class: "audit-ids", title: ids.concat(missing).join("\n") }, line),
          el(
            "div",
            { class: "muted small" },
            "→ ",
            el("code", null, entry.version || "—"),
            entry.parent_version ? ` from ${entry.parent_version}` : "",
          ),
        ),
      );
    }
  }

  // ---- admin token ---------------------------------------------------------------------------

  function initAdmin() {
    const panel = $("admin-panel");
    const toggle = $("admin-toggle");
    const paint = () => {
      const has = Boolean(admin.get());
      toggle.textContent = has ? "Admin ✓" : "Admin";
      toggle.classList.toggle("active", has);
      document.body.classList.toggle("has-admin", has);
    };
    toggle.addEventListener("click", () => {
      panel.hidden = !panel.hidden;
      toggle.setAttribute("aria-expanded", String(!panel.hidden));
      if (!panel.hidden) $("admin-token").focus();
    });
    panel.addEventListener("submit", async (e) => {
      e.preventDefault();
      const token = $("admin-token").value.trim();
      if (!token) return;
      admin.set(token);
      $("admin-token").value = "";
      paint();
      try {
        await api("/v1/admin/versions", { admin: true });
        panel.hidden = true;
        toggle.setAttribute("aria-expanded", "false");
        hideBanner();
        refreshPage();
      } catch (err) {
        if (err.status === 401 || err.status === 403) {
          admin.set(null);
          paint();
        }
        showError(err, "admin token");
      }
    });
    $("admin-forget").addEventListener("click", () => {
      admin.set(null);
      $("admin-token").value = "";
      paint();
      refreshPage();
    });
    paint();
  }

  function refreshPage() {
    if (state.page === "versions") loadVersions();
    else if (state.page === "duplicates") loadDuplicatesPage();
  }

  // ---- start ---------------------------------------------------------------------------------

  function init() {
    $("banner-close").addEventListener("click", hideBanner);
    $("takedown-form").addEventListener("submit", submitTakedown);
    initAdmin();
    initSearch();
    window.addEventListener("hashchange", route);
    loadInfo();
    setInterval(() => {
      if (state.page !== "health") loadInfo();
    }, INFO_REFRESH_MS);
    route();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
