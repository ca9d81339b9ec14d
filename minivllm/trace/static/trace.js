// The trace page (minivllm/trace/page.py): draws one engine step of a minivllm trace at a time.
// Plain JavaScript, no library, so the page opens from file:// with no network. The trace format
// is documented on the docs' Trace page (docs/trace.md). In live mode (minivllm serve
// --enable-dashboard) the same code polls the server for recent steps instead.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const embedded = JSON.parse($("trace-data").textContent);
  const live = JSON.parse($("page-config").textContent).live;

  let trace = embedded || { steps: [], sequences: {} };
  let index = 0; // position in trace.steps of the step on screen
  let timer = null; // the play loop
  let apiKey = sessionStorage.getItem("minivllm-dashboard-key") || "";
  const requestOrder = new Map(); // request id -> ordinal, for stable colours

  // ------------------------------------------------------------------ helpers
  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const child of children || []) node.append(child);
    return node;
  }

  function colour(requestId) {
    if (!requestOrder.has(requestId)) requestOrder.set(requestId, requestOrder.size);
    const hue = (requestOrder.get(requestId) * 137.508 + 210) % 360; // golden angle: far apart
    return `hsl(${hue.toFixed(0)} 55% 42%)`;
  }

  function seqInfo(seqId) {
    return trace.sequences[String(seqId)] || null;
  }

  function seqName(seqId) {
    const info = seqInfo(seqId);
    if (!info) return `seq ${seqId}`;
    // The one naming of the tutorials: "seq 3 (request 2)", "#1" for a second sample.
    return `seq ${seqId} (request ${info.request_id}${info.index ? ` #${info.index}` : ""})`;
  }

  function seqColour(seqId) {
    const info = seqInfo(seqId);
    return info ? colour(info.request_id) : "#78909c";
  }

  function tokenText(info, i) {
    if (info.tokens) return info.tokens[i];
    return String(info.token_ids[i]) + " ";
  }

  function dot(seqId) {
    return el("span", { class: "dot", style: `background:${seqColour(seqId)}` });
  }

  // ------------------------------------------------------------------ the header
  function renderMeta() {
    if (trace.num_blocks === undefined) return;
    const parts = [
      trace.model,
      `block_size ${trace.block_size}`,
      `${trace.num_blocks} blocks`,
      `max_num_batched_tokens ${trace.max_num_batched_tokens}`,
      `max_num_seqs ${trace.max_num_seqs}`,
      `prefix caching ${trace.enable_prefix_caching ? "on" : "off"}`,
    ];
    if (trace.max_loras !== undefined) parts.push(`LoRA: max_loras ${trace.max_loras}`);
    if (trace.pipeline_parallel_size > 1) {
      parts.push(`${trace.pipeline_parallel_size} pipeline stages: as many batches in flight`);
    }
    if (live) parts.push(`live: the last ${trace.max_steps} steps`);
    $("meta").textContent = parts.join(" · ");
  }

  // ------------------------------------------------------------------ the block pool
  function ensureGrid() {
    const grid = $("grid");
    if (grid.childElementCount === trace.num_blocks) return;
    grid.replaceChildren();
    for (let b = 0; b < trace.num_blocks; b++) {
      grid.append(el("div", { class: "block", "data-block": b, "data-refcount": 0 }));
    }
  }

  // Every KV cache group's tables, {seq id: table} each: one group for most models; a model that
  // mixes windowed and global layers (Gemma) has one per group of layers, the first's in
  // block_tables and the others' in group_block_tables.
  function groupTables(step) {
    return [step.block_tables, ...(step.group_block_tables || [])];
  }

  function owners(step) {
    const byBlock = new Map(); // block id -> [seq ids holding it]
    for (const tables of groupTables(step)) {
      for (const [seq, table] of Object.entries(tables)) {
        for (const b of table) {
          if (b === null) continue; // an entry the sliding window freed holds no block
          if (!byBlock.has(b)) byBlock.set(b, []);
          byBlock.get(b).push(Number(seq));
        }
      }
    }
    return byBlock;
  }

  // Blocks the sliding window freed in this step: entries that held a block the step before and
  // are null now, in any group. [[seq id, logical index, block id]]
  function windowFreed(step) {
    const before = trace.steps[trace.steps.indexOf(step) - 1];
    if (!before) return [];
    const out = [];
    const previous = groupTables(before);
    groupTables(step).forEach((tables, g) => {
      for (const [seq, table] of Object.entries(tables)) {
        const prev = (previous[g] || {})[seq] || [];
        table.forEach((b, i) => { if (b === null && prev[i] != null) out.push([Number(seq), i, prev[i]]); });
      }
    });
    return out;
  }

  function renderPool(step) {
    ensureGrid();
    const held = owners(step);
    const cached = new Set(step.cached_blocks);
    const copied = new Set(step.copies.map((c) => c[1]));
    const evicted = new Set(step.evicted);
    const hits = new Set(step.cache_hits.flatMap((h) => h.blocks));
    // A preempted sequence leaves the tables at once: mark the blocks it held the step before.
    const before = trace.steps[trace.steps.indexOf(step) - 1];
    const freed = new Set(before ? step.preempted.flatMap((s) =>
      groupTables(before).flatMap((tables) => tables[String(s)] || [])) : []);
    for (const [, , b] of windowFreed(step)) freed.add(b);
    let shared = 0;
    for (const node of $("grid").children) {
      const b = Number(node.dataset.block);
      const rc = step.ref_counts[String(b)] || 0;
      const seqs = held.get(b) || [];
      const classes = ["block"];
      if (rc > 0) classes.push("owned");
      if (rc > 1) { classes.push("shared"); shared++; }
      if (rc === 0 && cached.has(b)) classes.push("cached");
      if (copied.has(b)) classes.push("copied");
      if (evicted.has(b)) classes.push("evicted");
      if (hits.has(b)) classes.push("hit");
      if (freed.has(b) && rc === 0) classes.push("freed");  // shared ones are still held
      node.className = classes.join(" ");
      node.dataset.refcount = rc;
      node.dataset.owners = seqs.join(" ");
      node.dataset.cached = cached.has(b) ? "1" : "0";
      node.style.backgroundColor = rc > 0 ? seqColour(seqs[0]) : "";
      node.replaceChildren(String(b), el("span", { class: "rc", text: rc > 0 ? `×${rc}` : "" }));
      let title = `block ${b}: reference count ${rc}`;
      if (seqs.length) title += `; held by ${seqs.map(seqName).join(", ")}`;
      if (cached.has(b)) title += rc ? "; in the prefix cache" : "; free, still in the prefix cache";
      node.title = title;
    }
    const used = trace.num_blocks - step.num_free_blocks;
    $("pool-summary").textContent =
      `${used} of ${trace.num_blocks} held, ${shared} shared, ` +
      `${step.cached_blocks.length} in the prefix cache, ${step.num_free_blocks} free`;
  }

  // ------------------------------------------------------------------ the batch and its events
  function kindOf(item, step) {
    const info = seqInfo(item.seq_id);
    const prompt = info ? info.num_prompt_tokens : Infinity;
    const start = item.num_computed_tokens;
    const end = start + item.num_new_tokens;
    const hit = step.cache_hits.find((h) => h.seq_id === item.seq_id);
    const cachedNote = hit ? ` after a ${hit.num_cached_tokens}-token cache hit` : "";
    // "resume": a preempted sequence coming back, its tokens recomputed or found in the cache
    // (one word for it here, in the events, in tutorial 09 and in the docs).
    if (hit && start >= prompt) return `resume tokens ${start}–${end - 1}${cachedNote}`;
    if (item.num_spec_tokens) {  // speculative decoding: the newest token and k drafts
      const kept = item.num_accepted_tokens || 0;
      const rejected = item.num_spec_tokens - kept;
      return `verify ${item.num_spec_tokens} drafts: ${kept} kept, ${rejected} rejected` +
        (rejected ? ` (slots ${end - rejected}–${end - 1} given back)` : "");
    }
    if (start >= prompt && item.num_new_tokens === 1) return "decode";
    if (end > prompt) return `resume tokens ${start}–${end - 1}${cachedNote}`;
    const whole = start === (hit ? hit.num_cached_tokens : 0) && end === prompt;
    return (whole ? "prefill" : "prefill chunk") + ` tokens ${start}–${end - 1}${cachedNote}`;
  }

  // With LoRA on, each row's adapter and the device slot its rows ran with (-1: the base model).
  function adapterCell(item) {
    const text = item.lora_slot < 0 ? "base model" : `${item.lora_name} (slot ${item.lora_slot})`;
    return el("td", { "data-lora-slot": item.lora_slot, text });
  }

  function renderBatch(step) {
    const body = $("batch").tBodies[0];
    body.replaceChildren();
    const lora = step.lora_slots !== undefined;
    $("lora-head").hidden = !lora;
    for (const item of step.scheduled) {
      const cells = [
        el("td", {}, [dot(item.seq_id), String(item.seq_id)]),
        el("td", { text: item.request_id }),
        el("td", { class: "num", text: item.num_computed_tokens }),
        el("td", { class: "num", text: item.num_new_tokens }),
        el("td", { text: kindOf(item, step) }),
      ];
      if (lora) cells.push(adapterCell(item));
      body.append(el("tr", { "data-seq": item.seq_id }, cells));
    }
    $("lora-slots").hidden = !lora;
    if (lora) {
      const resident = Object.entries(step.lora_slots).map(([slot, name]) => `${slot}: ${name}`);
      $("lora-slots").textContent =
        `LoRA slots after the step (of ${trace.max_loras}): ${resident.join(", ") || "none"}`;
    }
    $("batch-summary").textContent =
      `${step.scheduled.length} sequences, ${step.num_batched_tokens} of ` +
      `${trace.max_num_batched_tokens} tokens; ${step.num_running} running, ` +
      `${step.num_waiting} waiting after the step`;
    renderPipeline(step);
    // The waiting queue, front first (traces recorded before it was kept have only its length).
    const queue = step.waiting || [];
    $("waiting").textContent = step.num_waiting
      ? `Waiting, front of the queue first: ${queue.length ? queue.map(seqName).join(", ") : step.num_waiting + " sequences"}`
      : "Waiting: nobody";
  }

  // With pipeline stages, a record is one batch as it commits; the batches launched after it are
  // still in the later stages (stage 0 has run them).
  function renderPipeline(step) {
    const line = $("pipeline");
    line.hidden = !(trace.pipeline_parallel_size > 1) || step.batch === undefined;
    if (line.hidden) return;
    const inFlight = step.in_flight || [];
    line.dataset.batch = step.batch;
    line.dataset.inFlight = inFlight.join(",");
    const stages = trace.pipeline_parallel_size;
    line.textContent = `Batch ${step.batch}, back from stage ${stages - 1}; in flight: ` +
      (inFlight.length
        ? inFlight.map((b) => `batch ${b}`).join(", ") + ` (past stage 0, in stages 1..${stages - 1})`
        : "none");
  }

  function renderEvents(step) {
    const items = [];
    const add = (kind, text) => items.push(el("li", { "data-kind": kind }, [
      el("span", { class: "kind", text: kind + ": " }), text,
    ]));
    for (const s of step.preempted) {
      add("preempted", `${seqName(s)} — its blocks are freed; it waits at the front of the queue and will resume, recomputing what the prefix cache no longer holds`);
    }
    for (const [src, dst] of step.copies) {
      add("copy-on-write", `block ${src} → block ${dst}: a sequence wrote into a shared, partly filled block`);
    }
    for (const h of step.cache_hits) {
      add("cache hit", `${seqName(h.seq_id)} took ${h.num_cached_tokens} tokens (blocks ${h.blocks.join(", ")}) from the prefix cache`);
    }
    for (const b of step.evicted) {
      add("evicted", `block ${b} lost its prefix-cache name: it was free and is reused for other tokens`);
    }
    for (const s of step.forked) {
      add("forked", `${seqName(s)} shares every block of its parent (n > 1): reference counts go up`);
    }
    const slid = new Map(); // seq id -> blocks the window freed this step
    for (const [seq, , b] of windowFreed(step)) slid.set(seq, [...(slid.get(seq) || []), b]);
    for (const [seq, freedBlocks] of slid) {
      add("out of window", `${seqName(seq)} — no query of it can see block${freedBlocks.length > 1 ? "s" : ""} ${freedBlocks.join(", ")} again (sliding window): freed, its cache name kept`);
    }
    for (const s of step.finished) {
      add("finished", `${seqName(s)} (${step.finish_reasons[String(s)]}) — its blocks are freed`);
    }
    if (!items.length) items.push(el("li", { class: "none", text: "no events: every sequence just advanced" }));
    $("events").replaceChildren(...items);
  }

  // ------------------------------------------------------------------ block tables
  // A KV cache group's name beside its row, where there are several: which layers it serves.
  function groupName(g) {
    const group = (trace.kv_cache_groups || [])[g];
    if (!group) return "";
    const kind = group.sliding_window === null ? "global" : `window ${group.sliding_window}`;
    return `group ${g}: ${kind}, layers ${group.layers.join(", ")}`;
  }

  function renderTables(step) {
    const rows = [];
    const seqIds = Object.keys(step.block_tables).map(Number).sort((a, b) => a - b);
    const groups = groupTables(step);
    for (const seq of seqIds) {
      groups.forEach((tables, g) => rows.push(tableRow(step, seq, tables[String(seq)] || [], g)));
    }
    if (!rows.length) rows.push(el("p", { text: "no sequence holds blocks after this step" }));
    $("tables").replaceChildren(...rows);
  }

  // One sequence's block table in one KV cache group (`g`), an entry per logical block.
  function tableRow(step, seq, table, g) {
    const bs = trace.block_size;
    const info = seqInfo(seq);
    const computed = step.num_computed_tokens[String(seq)];
    const cells = table.map((b, i) => {
      const toks = el("span", { class: "toks" });
      if (info) {
        const end = Math.min((i + 1) * bs, computed, info.token_ids.length);
        for (let t = i * bs; t < end; t++) toks.append(el("span", { class: "tok", text: tokenText(info, t) }));
        const empty = (i + 1) * bs - Math.max(end, i * bs);
        if (empty > 0) toks.append(el("span", { class: "pending", text: " ·".repeat(empty) }));
      }
      if (b === null) { // freed under the sliding window: its tokens are out of every query's sight
        return el("span", { class: "lblock outside", "data-logical": i, title: "outside the sliding window: freed" }, [
          el("span", { class: "map", text: `${i} → freed` }), el("br"), toks,
        ]);
      }
      const sharedCls = (step.ref_counts[String(b)] || 0) > 1 ? " shared" : "";
      return el("span", { class: "lblock" + sharedCls, "data-logical": i, "data-block": b }, [
        el("span", { class: "map", text: `${i} → ${b}` }), el("br"), toks,
      ]);
    });
    const held = `${computed} tokens in ${table.filter((b) => b !== null).length} blocks`;
    const group = groupName(g);
    return el("div", { class: "seqrow", "data-seq": seq, "data-group": g }, [
      el("span", { class: "seqname" }, [dot(seq), seqName(seq), el("br"),
        el("small", { text: held }), ...(group ? [el("br"), el("small", { text: group })] : [])]),
      ...cells,
    ]);
  }

  // ------------------------------------------------------------------ KV usage over the run
  function renderUsage() {
    const svg = $("usage");
    const steps = trace.steps;
    svg.replaceChildren();
    if (!steps.length) return;
    const ns = "http://www.w3.org/2000/svg";
    const x = (i) => (steps.length === 1 ? 500 : (i / (steps.length - 1)) * 1000);
    const y = (s) => 118 - (108 * (trace.num_blocks - s.num_free_blocks)) / trace.num_blocks;
    const pts = steps.map((s, i) => `${x(i).toFixed(1)},${y(s).toFixed(1)}`);
    const area = document.createElementNS(ns, "polygon");
    area.setAttribute("class", "area");
    area.setAttribute("points", `0,118 ${pts.join(" ")} 1000,118`);
    const curve = document.createElementNS(ns, "polyline");
    curve.setAttribute("class", "curve");
    curve.setAttribute("points", pts.join(" "));
    const cursor = document.createElementNS(ns, "line");
    cursor.setAttribute("class", "cursor");
    cursor.setAttribute("id", "usage-cursor");
    cursor.setAttribute("y1", "0");
    cursor.setAttribute("y2", "120");
    const title = document.createElementNS(ns, "title");
    title.textContent = "blocks held / all blocks, per step; click to go to a step";
    const line = (cls, x1, y1, x2, y2) => {
      const l = document.createElementNS(ns, "line");
      l.setAttribute("class", cls);
      [["x1", x1], ["y1", y1], ["x2", x2], ["y2", y2]].forEach(([k, v]) => l.setAttribute(k, v));
      return l;
    };
    const marks = [line("axis", 0, 118, 1000, 118), line("axis", 0, 10, 0, 118)];
    steps.forEach((s, i) => {  // preemptions as red ticks along the top, copies orange below them
      if (s.preempted.length) marks.push(line("preempt", x(i), 0, x(i), 40));
      if (s.copies.length) marks.push(line("copy", x(i), 42, x(i), 62));
    });
    svg.append(title, area, curve, ...marks, cursor);
    $("usage-ymax").textContent = String(trace.num_blocks);
    $("usage-xmin").textContent = String(steps[0].step);
    $("usage-xmax").textContent = String(steps[steps.length - 1].step);
  }

  function moveCursor() {
    const cursor = $("usage-cursor");
    if (!cursor) return;
    const n = trace.steps.length;
    const xPos = n <= 1 ? 500 : (index / (n - 1)) * 1000;
    cursor.setAttribute("x1", xPos);
    cursor.setAttribute("x2", xPos);
  }

  // ------------------------------------------------------------------ navigation
  function show(i, fromUser) {
    const steps = trace.steps;
    if (!steps.length) {
      $("step-label").textContent = "no steps yet";
      return;
    }
    index = Math.max(0, Math.min(steps.length - 1, i));
    if (fromUser && live && index !== steps.length - 1) $("follow").checked = false;
    const step = steps[index];
    const slider = $("slider");
    slider.max = steps.length - 1;
    slider.value = index;
    $("step-label").textContent = `step ${step.step} / ${steps[steps.length - 1].step}`;
    renderPool(step);
    renderBatch(step);
    renderEvents(step);
    renderTables(step);
    moveCursor();
    history.replaceState(null, "", `#step=${step.step}`);
  }

  function stepFromHash() {
    const match = /(?:^#|&)step=(\d+)/.exec(location.hash);
    if (!match) return null;
    const k = Number(match[1]);
    const i = trace.steps.findIndex((s) => s.step === k);
    return i >= 0 ? i : null;
  }

  function togglePlay() {
    if (timer) {
      clearInterval(timer);
      timer = null;
      $("play").textContent = "play";
      return;
    }
    if (index >= trace.steps.length - 1 && !live) show(0, true);
    $("play").textContent = "pause";
    timer = setInterval(() => {
      if (index < trace.steps.length - 1) show(index + 1, true);
      else if (!live) togglePlay();
    }, 600);
  }

  $("first").addEventListener("click", () => show(0, true));
  $("prev").addEventListener("click", () => show(index - 1, true));
  $("next").addEventListener("click", () => show(index + 1, true));
  $("last").addEventListener("click", () => show(trace.steps.length - 1, true));
  $("play").addEventListener("click", togglePlay);
  $("slider").addEventListener("input", (e) => show(Number(e.target.value), true));
  $("usage").addEventListener("click", (e) => {
    const box = e.currentTarget.getBoundingClientRect();
    show(Math.round(((e.clientX - box.left) / box.width) * (trace.steps.length - 1)), true);
  });
  document.addEventListener("keydown", (e) => {
    if (e.target instanceof HTMLInputElement && e.target.type !== "range") return;
    if (e.target instanceof HTMLButtonElement && e.key === " ") return;
    const moves = { ArrowLeft: -1, ArrowRight: 1, ArrowDown: -1, ArrowUp: 1 };
    if (e.key in moves) show(index + moves[e.key], true);
    else if (e.key === "Home") show(0, true);
    else if (e.key === "End") show(trace.steps.length - 1, true);
    else if (e.key === " ") togglePlay();
    else return;
    e.preventDefault(); // a focused slider would move a second time
  });
  window.addEventListener("hashchange", () => {
    const i = stepFromHash();
    if (i !== null && i !== index) show(i, true);
  });

  // ------------------------------------------------------------------ live: poll the server
  async function poll() {
    const last = trace.steps.length ? trace.steps[trace.steps.length - 1].step : 0;
    const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
    let response;
    try {
      response = await fetch(`${live.endpoint}?after=${last}`, { headers, cache: "no-store" });
    } catch (err) {
      $("status").textContent = "server unreachable; retrying";
      return;
    }
    if (response.status === 401) {
      $("key-form").hidden = false;
      $("status").textContent = "this server needs its API key";
      return;
    }
    if (!response.ok) {
      $("status").textContent = `server answered ${response.status}; retrying`;
      return;
    }
    const update = await response.json();
    $("key-form").hidden = true;
    const first = trace.num_blocks === undefined;
    const steps = trace.steps.concat(update.steps);
    const sequences = Object.assign({}, trace.sequences, update.sequences);
    Object.assign(trace, update, { steps: steps.slice(-update.max_steps), sequences: {} });
    for (const s of trace.steps) { // keep only the sequences the window still shows
      const ids = [...Object.keys(s.block_tables), ...s.scheduled.map((x) => x.seq_id),
        ...s.finished, ...s.preempted];
      for (const id of ids) if (sequences[id]) trace.sequences[id] = sequences[id];
    }
    if (first) renderMeta();
    $("status").textContent = `live · ${update.num_recorded} steps so far`;
    if (update.steps.length || first) {
      renderUsage();
      const follow = $("follow").checked;
      const wanted = first ? stepFromHash() : null;
      if (wanted !== null) show(wanted, false);
      else if (follow) show(trace.steps.length - 1, false);
      else show(Math.max(0, index - Math.max(0, steps.length - trace.steps.length)), false);
    }
  }

  async function pollForever() {
    await poll();
    setTimeout(pollForever, live.poll_ms);
  }

  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("key").value;
    sessionStorage.setItem("minivllm-dashboard-key", apiKey);
    poll();
  });

  // ------------------------------------------------------------------ start
  if (live) {
    $("follow-label").hidden = false;
    $("status").textContent = "connecting";
    pollForever();
  } else {
    renderMeta();
    renderUsage();
    const start = stepFromHash();
    show(start === null ? 0 : start, false);
  }
})();
