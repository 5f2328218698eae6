// The clawloop dashboard: polls the read-only JSON views under ./api and renders the view named in the URL hash.
// Every piece of run data is inserted as text (textContent), never as HTML: conversations are user input.
(function () {
  "use strict";

  const POLL_MS = 2000;
  const KEY_STORE = "clawloop-admin-key";
  const VIEWS = ["overview", "conversations", "sample", "training", "versions"];
  // Messages longer than these are folded to their first line (an agent's system prompt runs to thousands of
  // characters and would fill the screen on every session's first turn); a click unfolds them.
  const FOLD_CHARS = { system: 300, other: 2000 };
  const FOLD_PREVIEW = 160;
  const state = { view: "overview", arg: null, session: null, last: {}, charts: [], timer: null, busy: false,
    unfolded: new Set() };

  // ---- small DOM helpers ---------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }
  const $ = (id) => document.getElementById(id);
  function fill(id, ...children) {
    const n = $(id);
    n.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
    return n;
  }
  function fmt(x, digits = 3) {
    if (x === null || x === undefined) return "–";
    if (typeof x !== "number") return String(x);
    if (Number.isInteger(x)) return String(x);
    const a = Math.abs(x);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(2) : x.toFixed(digits);
  }
  function time(t) { return t ? new Date(t * 1000).toLocaleTimeString() : "–"; }
  function ago(t) {
    if (!t) return "";
    const s = Math.max(0, Date.now() / 1000 - t);
    return s < 60 ? `${Math.round(s)}s ago` : s < 3600 ? `${Math.round(s / 60)}m ago` : `${(s / 3600).toFixed(1)}h ago`;
  }
  function chip(text, kind) { return el("span", { class: `chip ${kind || ""}`, text }); }
  function kv(rows) {
    return el("table", { class: "kv" }, rows.map(([k, v]) => el("tr", {}, el("th", { text: k }),
      el("td", {}, v instanceof Node ? v : fmt(v)))));
  }
  function bars(counts, testid) {
    const entries = Object.entries(counts || {}).sort((a, b) => b[1] - a[1]);
    if (!entries.length) return el("p", { class: "muted", text: "none" });
    const max = Math.max(...entries.map((e) => e[1]));
    return el("div", { class: "bars", "data-testid": testid }, entries.map(([k, v]) => el("div", { class: "bar-row" },
      el("span", { class: "bar-label", text: k }),
      el("span", { class: "bar" }, el("span", { class: `bar-fill st-${k}`, style: `width:${(100 * v) / max}%` })),
      el("span", { class: "bar-value", text: String(v) }))));
  }

  // ---- fetching ------------------------------------------------------------------------------------------
  async function api(path) {
    const headers = {};
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = `Bearer ${key}`;
    const res = await fetch(`api/${path}`, { headers, cache: "no-store" });
    if (res.status === 401 || res.status === 403) {
      const body = await res.json().catch(() => ({}));
      const err = new Error((body.error && body.error.message) || `HTTP ${res.status}`);
      err.auth = true;
      throw err;
    }
    if (res.status === 404) return null;
    if (!res.ok) {
      const body = await res.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${res.status}`);
    }
    return res.json();
  }
  // Calls render(data) only when the data changed, so open details, scroll and hover survive a poll.
  async function load(path, render) {
    const data = await api(path);
    const sig = JSON.stringify(data);
    if (state.last[path] === sig) return data;
    state.last[path] = sig;
    render(data);
    return data;
  }

  // ---- overview ------------------------------------------------------------------------------------------
  function renderOverview(d) {
    const judge = d.judge || {};
    fill("ov-cards",
      card("policy version", `v${d.policy_version}`, d.policy_version_from, "ov-version"),
      card("optimizer steps", d.steps, d.last_step ? `last ${ago(d.last_step.created_at)}, loss ${fmt(d.last_step.loss)}` : "none yet", "ov-steps"),
      card("samples waiting", d.samples_waiting, "ready for the trainer", "ov-waiting"),
      card("turns stored", d.turns_total, `${d.throughput.turns} in the last 5 min`, "ov-turns-total"),
      card("judge", judgeName(judge), judge.invalid_rate === null || judge.invalid_rate === undefined ? "no votes yet" :
        `${fmt(100 * judge.invalid_rate, 1)}% invalid of ${judge.votes} votes`, "ov-judge-card"),
      card("rollbacks", d.rollbacks, "returns to an earlier version", "ov-rollbacks"));
    fill("ov-turns", bars(d.turns_by_state, "turns-by-state"));
    fill("ov-drops", bars(d.drop_reasons, "drop-reasons"));
    fill("ov-kinds", bars(d.samples_by_kind || {}, "samples-by-kind"),
      d.context_turns ? el("p", { class: "muted small", text: `${d.context_turns} context samples: teacher answers stored as turns of their own (not counted as turns stored)` }) : null);
    const errs = Object.entries(judge.top_errors || {});
    fill("ov-judge", kv([["backend", judgeName(judge)], ["judging", judge.judging === undefined ? "–" : String(judge.judging)],
      ["votes", judge.votes], ["invalid", judge.invalid], ["invalid rate", judge.invalid_rate]]),
      judge.sees ? el("p", { class: "muted small", text: `Sees: ${judge.sees}` }) : null,
      errs.length ? el("ul", { class: "small" }, errs.map(([e, n]) => el("li", { text: `${n}× ${e}` }))) : null);
    const s = d.serving || {};
    const lat = s.chat_latency || {};
    fill("ov-serving", kv([["turns / min (5 min)", d.throughput.turns_per_min],
      ["response tokens / s (5 min)", d.throughput.response_tokens_per_s],
      ["chat requests", lat.count], ["chat latency mean (s)", lat.mean_s],
      ["chat latency p50 ≤ (s)", lat.p50_le_s], ["chat latency p95 ≤ (s)", lat.p95_le_s],
      ["live sessions", s.live_sessions], ["uptime (s)", s.uptime_s]]),
      d.live ? null : el("p", { class: "muted small", text: "A finished run read from its folder: latency is known only to a running server." }));
    const g = d.gate || {};
    fill("ov-gate", bars(g.events_by_kind, "gate-kinds"),
      (g.recent || []).length ? eventTable(g.recent) : el("p", { class: "muted", text: "No gate decision yet." }));
  }
  function judgeName(judge) {
    return judge.backend || (judge.recorded === false ? "not recorded" : "–");
  }
  function card(label, value, note, testid) {
    return el("div", { class: "card", "data-testid": testid }, el("div", { class: "card-label", text: label }),
      el("div", { class: "card-value", text: String(value) }), el("div", { class: "card-note", text: note || "" }));
  }
  function eventTable(events) {
    return el("table", { class: "table" }, el("tr", {}, ["time", "event", "step", "version", "detail"].map((h) => el("th", { text: h }))),
      events.map((e) => el("tr", {}, el("td", { text: time(e.created_at) }), el("td", {}, chip(e.kind, e.kind)),
        el("td", { text: e.step ?? "–" }), el("td", { text: e.version ?? "–" }),
        el("td", { class: "small", text: Object.entries(e.detail || {}).map(([k, v]) => `${k}=${typeof v === "number" ? fmt(v) : v}`).join("  ") }))));
  }

  // ---- conversations -------------------------------------------------------------------------------------
  function sessionHash(id, owner) {
    return `#conversations/${encodeURIComponent(id)}${owner ? `/${encodeURIComponent(owner)}` : ""}`;
  }
  function renderSessions(d) {
    const list = d.sessions || [];
    if (!state.session && list.length) state.session = { id: list[0].session_id, owner: list[0].owner || "" };
    const current = (s) => state.session && s.session_id === state.session.id && (s.owner || "") === state.session.owner;
    fill("session-list", list.length ? list.map((s) => el("li", {
      class: current(s) ? "active" : "", "data-session": s.session_id,
      onclick: () => { location.hash = sessionHash(s.session_id, s.owner); },
    }, el("div", { class: "sid", text: s.owner ? `${s.session_id} · ${s.owner}` : s.session_id }),
      el("div", { class: "small muted", text: `${s.turns} turn${s.turns === 1 ? "" : "s"} · ${ago(s.updated_at)}` }),
      el("div", {}, Object.entries(s.states).map(([k, v]) => chip(`${k} ${v}`, k))))) :
      el("li", { class: "muted", text: "No conversation yet." }));
  }
  function message(m, key) {
    // An assistant message that only calls tools has null content: show its calls rather than "null".
    const text = typeof m.content === "string" ? m.content : m.content == null ? "" : JSON.stringify(m.content);
    const calls = (m.tool_calls || []).map((c) => `→ ${(c.function || {}).name || "tool"}(${(c.function || {}).arguments || ""})`);
    const content = [text, ...calls].filter((x) => x).join("\n");
    const limit = m.role === "system" ? FOLD_CHARS.system : FOLD_CHARS.other;
    if (content.length <= limit) {
      return el("div", { class: `msg role-${m.role}` }, el("span", { class: "role", text: m.role }), el("span", { text: content }));
    }
    // Folded by default; a poll that re-renders the turn keeps it open once opened (state.unfolded).
    const preview = content.slice(0, FOLD_PREVIEW).split("\n")[0];
    const fold = el("details", { class: "fold", open: state.unfolded.has(key) },
      el("summary", {}, el("span", { text: `${preview}… ` }),
        el("span", { class: "muted small", text: `(${content.length.toLocaleString("en")} characters, click to show all)` })),
      el("div", { class: "fold-body", text: content }));
    fold.addEventListener("toggle", () => { if (fold.open) state.unfolded.add(key); else state.unfolded.delete(key); });
    return el("div", { class: `msg role-${m.role} folded` }, el("span", { class: "role", text: m.role }), fold);
  }
  function renderSession(d) {
    if (!d) { fill("session-detail", el("p", { class: "muted", text: "Unknown session." })); return; }
    fill("session-detail", el("h3", { text: `Session ${d.session_id}${d.owner ? ` of ${d.owner}` : ""}` }), d.turns.map((t) => {
      const votes = t.votes || [];
      const smp = t.sample;
      const chosen = smp && smp.chosen_hint ? smp.chosen_hint.index : null;
      return el("article", { class: "turn", "data-turn": t.turn_id },
        el("div", { class: "turn-head" }, el("b", { text: `turn ${t.turn_id}` }),
          el("span", { class: "muted", text: ` #${t.turn_index} · served by v${t.policy_version} · ${time(t.created_at)}` }),
          chip(t.state, t.state), chip(t.fate.text, `fate-${t.fate.fate}`),
          t.context_of ? chip(`context answer of turn ${t.context_of}`, "context") : null,
          (t.context_turn_ids || []).length ? chip(`${t.context_turn_ids.length} context answers: turns ${t.context_turn_ids.join(", ")}`, "context") : null,
          smp ? el("a", { href: `#sample/${t.turn_id}`, class: "link", text: "tokens →" }) : null),
        el("div", { class: "label", text: "request (last messages)" }), (t.request_tail || []).map((m, i) => message(m, `${t.turn_id}:request:${i}`)),
        el("div", { class: "label", text: `answer (${t.response_tokens} tokens, ${t.finish_reason})` }),
        el("div", { class: "msg role-assistant answer" }, el("span", { class: "role", text: "assistant" }), el("span", { text: t.answer })),
        el("div", { class: "label", text: "next state" }),
        t.next_state ? t.next_state.map((m, i) => message(m, `${t.turn_id}:next:${i}`)) : el("p", { class: "muted small", text: "none (yet)" }),
        votes.length ? el("div", {}, el("div", { class: "label", text: "judge votes" }),
          el("table", { class: "table votes" }, el("tr", {}, ["kind", "#", "score", "hint", "raw text"].map((h) => el("th", { text: h }))),
            votes.map((v) => el("tr", { class: v.superseded ? "superseded" : "" }, el("td", { text: v.kind }), el("td", { text: v.index }),
              el("td", {}, v.score === null ? chip(v.error ? "invalid" : "none", "dropped") : chip(v.score > 0 ? `+${v.score}` : String(v.score), v.score > 0 ? "pos" : v.score < 0 ? "neg" : "")),
              el("td", { text: v.hint || "" }),
              el("td", {}, el("details", {}, el("summary", { text: (v.raw_text || v.error || "").split("\n")[0].slice(0, 80) }), el("pre", { text: v.raw_text || v.error })))))))
          : null,
        smp ? el("div", {}, el("div", { class: "label", text: `sample: ${smp.kind}, reward ${fmt(smp.reward)}` }),
          smp.hints.length ? el("ol", { class: "hints", start: 0 }, smp.hints.map((h, i) => el("li", { class: i === chosen ? "chosen" : "" },
            el("span", { text: h }), i === chosen ? chip(`chosen (${smp.chosen_hint.selection})`, "pos") : null)))
            : el("p", { class: "muted small", text: "no hint candidate" })) : null);
    }));
  }

  // ---- one sample, token by token ----------------------------------------------------------------------
  function advColour(a, clip) {
    if (a === null || a === undefined) return null;
    const c = clip || 1;
    const x = Math.max(-1, Math.min(1, a / c));
    const alpha = (0.15 + 0.75 * Math.abs(x)).toFixed(3);
    return x >= 0 ? `rgba(22, 150, 80, ${alpha})` : `rgba(210, 50, 50, ${alpha})`;
  }
  function shown(text) { return text.replace(/\n/g, "↵\n").replace(/ /g, "\u00a0"); }
  function renderSample(d) {
    if (!d) {
      fill("sample-title", "Sample");
      fill("sample-meta", el("p", { class: "muted", text: "No sample yet: the judge has not finished a turn." }));
      fill("tokens"); fill("grpo"); return;
    }
    $("sample-title").textContent = `Sample of turn ${d.turn_id}`;
    $("sample-clip").textContent = d.adv_clip ? `advantage = teacher − student log-prob, clipped to ±${d.adv_clip}` : "advantage = teacher − student log-prob";
    const ch = d.chosen_hint;
    fill("sample-meta", kv([["session", el("a", { href: sessionHash(d.session_id, d.owner), text: d.owner ? `${d.session_id} · ${d.owner}` : d.session_id })],
      ["served by", `v${d.policy_version}`], ["tokens", `${d.shown_tokens} of ${d.response_tokens}`],
      ["chosen hint", ch ? `#${ch.index} (${ch.selection}): ${ch.hint}` : d.has_targets ? "anchor (no hint)" : "no teacher targets"],
      ["fate", d.fate.text]]));
    fill("tokens", d.tokens.map((t) => {
      const bg = advColour(t.advantage, d.adv_clip);
      const span = el("span", { class: `tok${bg ? "" : " none"}`, "data-i": t.i, "data-adv": t.advantage ?? "",
        style: bg ? `background:${bg}` : null, text: shown(t.text) });
      span.addEventListener("mouseenter", (ev) => showTip(ev, t));
      span.addEventListener("mouseleave", hideTip);
      return span;
    }));
    const g = d.grpo;
    fill("grpo", g ? el("div", {}, el("h4", { text: "GRPO vote" }),
      el("p", {}, "reward ", chip(g.reward > 0 ? `+${g.reward}` : String(g.reward), g.reward > 0 ? "pos" : g.reward < 0 ? "neg" : ""), ` · sample kind ${g.kind}`),
      g.votes.map((v) => el("details", { class: "vote" }, el("summary", { text: `vote ${v.index}: ${v.score === null ? "invalid" : v.score}` }),
        el("pre", { text: v.raw_text || v.error })))) : el("p", { class: "muted", text: "Not judged into a sample." }));
  }
  function topList(title, items) {
    return el("div", { class: "toplist" }, el("div", { class: "label", text: title }),
      el("table", {}, items.map((e) => el("tr", { class: e.shared ? "shared" : "" },
        el("td", { class: "mono", text: JSON.stringify(e.text) }), el("td", { text: fmt(e.logprob, 2) })))));
  }
  function showTip(ev, t) {
    const tip = $("tooltip");
    tip.replaceChildren(el("div", { class: "mono", text: `${JSON.stringify(t.text)}  id ${t.id}  (#${t.i})` }),
      kv([["advantage", t.advantage], ["teacher log-prob", t.teacher_logprob], ["student log-prob", t.old_logprob],
        ["behaviour log-prob", t.behaviour_logprob], ["top-k overlap", t.k ? `${t.overlap} of ${t.k}` : "–"], ["hint", t.hint_index ?? "–"]]),
      t.student_topk ? el("div", { class: "toplists" }, topList("student top-k", t.student_topk), topList("teacher top-k", t.teacher_topk)) : null);
    tip.hidden = false;
    const r = ev.target.getBoundingClientRect();
    const x = Math.min(window.innerWidth - tip.offsetWidth - 12, Math.max(8, r.left));
    tip.style.left = `${x + window.scrollX}px`;
    tip.style.top = `${r.bottom + window.scrollY + 6}px`;
  }
  function hideTip() { $("tooltip").hidden = true; }

  // ---- training -----------------------------------------------------------------------------------------
  const CHARTS = [
    ["Loss by branch", ["loss", "grpo_loss", "opd_loss", "combine_loss", "topk_kl_loss"]],
    ["KL", ["ref_kl", "ppo_kl", "gate_kl"]],
    ["Grad norm", ["grad_norm"]],
    ["Clip fractions", ["grpo_clipfrac", "opd_clipfrac", "clipfrac"]],
    ["Top-k overlap at the chosen hint", ["opd_overlap_at_h_star"]],
    ["Teacher mass in the top-k", ["opd_teacher_mass"]],
    ["Reward and entropy", ["reward_mean", "entropy"]],
  ];
  const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
  function destroyCharts() { state.charts.forEach((c) => c.destroy()); state.charts = []; }
  function chart(host, title, xs, named, testid, xlabel = "step") {
    const box = el("div", { class: "panel chart", "data-testid": testid, "data-points": xs.length, "data-x": xs.join(",") }, el("h3", { text: title }));
    host.append(box);
    const width = Math.max(280, box.clientWidth - 24);
    const opts = { width, height: 180, legend: { show: true },
      scales: { x: { time: false }, y: { range: (u, lo, hi) => (lo === hi ? [lo - 1, hi + 1] : uPlot.rangeNum(lo, hi, 0.1, true)) } },
      axes: [{ label: xlabel, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000] }, { size: 64, values: (u, splits) => splits.map((v) => (v === null ? "" : v !== 0 && Math.abs(v) < 0.01 ? v.toExponential(1) : String(+v.toPrecision(3)))) }],
      series: [{ label: xlabel }, ...named.map(([name], i) => ({ label: name, stroke: COLOURS[i % COLOURS.length], width: 2, points: { show: true, size: 6 } }))] };
    state.charts.push(new uPlot(opts, [xs, ...named.map(([, ys]) => ys)], box));
  }
  function renderTraining(d) {
    destroyCharts();
    const host = fill("charts");
    if (!d.steps.length) host.append(el("p", { class: "panel muted", text: "No optimizer step yet." }));
    else {
      for (const [title, keys] of CHARTS) {
        const named = keys.filter((k) => d.series[k] && d.series[k].some((v) => v !== null)).map((k) => [k, d.series[k]]);
        if (named.length) chart(host, title, d.steps, named, `chart-${keys[0]}`);
      }
    }
    const ev = d.evaluations || [];
    if (ev.length) {
      chart(host, "Held-out evaluation (demo)", ev.map((_, i) => i), [["score", ev.map((e) => e.score)], ["guard_pass_rate", ev.map((e) => e.guard_pass_rate)]], "chart-eval", "evaluation");
      host.lastChild.append(el("p", { class: "small muted", text: `x = evaluation #: ${ev.map((e, i) => `${i} ${e.name}`).join(", ")}` }));
    }
    const i = d.steps.length - 1;
    fill("last-metrics", i < 0 ? el("p", { class: "muted", text: "–" }) : el("div", { class: "metric-grid" },
      Object.keys(d.series).sort().map((k) => el("div", {}, el("span", { class: "muted", text: k }), el("b", { text: fmt(d.series[k][i]) })))));
    if (d.requeued_steps.length) $("last-metrics").append(el("p", { class: "small", text: `Requeued after a resume: steps ${d.requeued_steps.map((r) => r.step).join(", ")}` }));
  }

  // ---- versions -----------------------------------------------------------------------------------------
  function renderVersions(d) {
    fill("version-list", d.versions.length ? d.versions.slice().reverse().map((v) => {
      const ev = v.evidence || {};
      return el("div", { class: `version st-${v.status}`, "data-version": v.version },
        el("div", { class: "version-head" }, el("b", { text: `v${v.version}` }), chip(v.status, v.status),
          v.owner ? el("span", { class: "muted", text: ` user ${v.owner}` }) : null,
          el("span", { class: "muted", text: ` step ${v.step} · ${time(v.created_at)}` })),
        el("div", { class: "small", text: v.steps.length ? `trained by step${v.steps.length > 1 ? "s" : ""} ${v.steps.join(", ")} on ${v.samples} sample${v.samples === 1 ? "" : "s"}` : "no step recorded for it" }),
        ("guard_pass" in ev || "kl" in ev) ? el("div", { class: "small", text: `gate: guard pass ${fmt(ev.guard_pass)}, KL ${fmt(ev.kl)}${ev.kl_to ? ` to ${ev.kl_to}` : ""}${ev.preference ? `, the hint's reward ${fmt(ev.preference.accepted_mean)} → ${fmt(ev.preference.candidate_mean)} ${ev.preference.accepted_sum_mean == null ? "nats" : "nats/token"}` : ""}${(ev.reasons || []).length ? `, reasons: ${ev.reasons.join("; ")}` : ""}` }) : null,
        el("details", {}, el("summary", { text: "evidence" }), el("pre", { text: JSON.stringify(ev, null, 1) })));
    }) : el("p", { class: "muted", text: "No version published yet." }));
    const outside = d.steps_in_no_version || [];
    fill("no-version", outside.length ? el("ul", { class: "small" }, outside.map((s) => el("li", { "data-step": s.step },
      chip(s.fate, `fate-${s.fate}`), el("span", { text: ` ${s.text} (${s.samples} sample${s.samples === 1 ? "" : "s"})` }))))
      : el("p", { class: "muted small", text: "None: every trained step is in a version." }));
    fill("timeline", d.timeline.length ? eventTable(d.timeline.slice().reverse()) : el("p", { class: "muted", text: "No gate decision, rollback or requeue yet." }));
    const receipts = d.forget_receipts || [];
    fill("receipts", receipts.length ? el("ul", { class: "small" }, receipts.slice().reverse().map((r) => el("li", { "data-owner": r.owner || "" },
      r.problem ? el("span", { text: `${r.file}: unreadable (${r.problem})` }) : el("span", {
        text: `${r.forgotten_at_utc} · ${r.owner}: ${(r.turn_ids || []).length} turns, ${r.sessions} sessions, ${r.votes} votes, ${r.samples} samples deleted; ` +
          `versions retired: ${(r.retired_versions || []).join(", ") || "none"}` + (r.user_policy_removed ? "; their own policy removed" : "") +
          `; training goes on from ${r.training_resumes_from}`,
      }),
      el("details", {}, el("summary", { text: "receipt" }), el("pre", { text: JSON.stringify(r, null, 1) })))))
      : el("p", { class: "muted small", text: "No user has been forgotten in this run." }));
  }

  // ---- routing and polling --------------------------------------------------------------------------------
  function parseHash() {
    const [view, ...rest] = location.hash.replace(/^#/, "").split("/");
    state.view = VIEWS.includes(view) ? view : "overview";
    state.arg = rest.length ? decodeURIComponent(rest[0]) : null;
    // A session is named by its id and its owner (two users may both call theirs "main"): #conversations/ID/OWNER.
    if (state.view === "conversations" && state.arg) state.session = { id: state.arg, owner: rest.length > 1 ? decodeURIComponent(rest[1]) : "" };
    document.querySelectorAll("#tabs a").forEach((a) => a.classList.toggle("active", a.dataset.view === state.view));
    document.querySelectorAll(".view").forEach((s) => { s.hidden = s.id !== `view-${state.view}`; });
    state.last = {};
    refresh();
  }
  async function refresh() {
    if (state.busy) return;
    state.busy = true;
    try {
      const ov = await api("overview");
      $("live-dot").className = `dot ${ov && ov.live ? "on" : "off"}`;
      $("status-text").textContent = ov ? `${ov.live ? "live" : "from the run folder"} · v${ov.policy_version} · step ${ov.steps} · updated ${new Date().toLocaleTimeString()}` : "no data";
      if (state.view === "overview") { const sig = JSON.stringify(ov); if (state.last.overview !== sig) { state.last.overview = sig; renderOverview(ov); } }
      else if (state.view === "conversations") {
        await load("sessions", renderSessions);
        if (state.session) await load(`sessions/${encodeURIComponent(state.session.id)}${state.session.owner ? `?owner=${encodeURIComponent(state.session.owner)}` : ""}`, renderSession);
      } else if (state.view === "sample") {
        await load(state.arg ? `samples/${encodeURIComponent(state.arg)}` : "samples/latest", renderSample);
      } else if (state.view === "training") await load("training", renderTraining);
      else if (state.view === "versions") await load("versions", renderVersions);
      $("banner").hidden = true;
    } catch (err) {
      $("live-dot").className = "dot off";
      $("banner").textContent = err.auth ? `${err.message} Enter the admin key to see this run.` : `Cannot read the run: ${err.message}`;
      $("banner").hidden = false;
      if (err.auth) $("key-form").hidden = false;
    } finally {
      state.busy = false;
    }
  }

  $("key-button").addEventListener("click", () => { $("key-form").hidden = !$("key-form").hidden; });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
    $("key-form").hidden = true;
    state.last = {};
    refresh();
  });
  $("sample-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const v = $("sample-input").value.trim();
    location.hash = v ? `#sample/${v}` : "#sample";
  });
  window.addEventListener("hashchange", parseHash);
  window.addEventListener("resize", () => { if (state.view === "training") { delete state.last.training; refresh(); } });
  parseHash();
  state.timer = setInterval(() => { if (!document.hidden) refresh(); }, POLL_MS);
})();
