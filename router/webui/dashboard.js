// The dashboard: scrapes /metrics and /info every second while it is shown,
// turns consecutive scrapes into rates and recent percentiles, and draws them.
//
//   scrape (counters, gauges, histogram buckets)
//     -> Sample (the numbers the dashboard reads, one per scrape)
//     -> Reading (rates between the last two samples; percentiles and the hit
//        rate over the samples of the last WINDOW_S seconds)
//     -> tiles (text) and charts (the last two minutes)

import { errorMessage, promptForKey, request } from "./api.js";
import { LineChart } from "./chart.js";
import { element } from "./dom.js";
import { bucketGrowth, buckets, parseMetrics, quantile, total } from "./prometheus.js";

const POLL_MS = 1000;
const WINDOW_S = 30;

// Every generated token records either a time to first token or an
// inter-token latency, so their counts together count tokens as they stream
// (sluice_generated_tokens_total only grows when a request ends).
function sampleOf(scrape, t) {
  const capacity = total(scrape, "sluice_kv_blocks_capacity");
  return {
    t,
    tokens: (total(scrape, "sluice_time_to_first_token_seconds_count") ?? 0) +
      (total(scrape, "sluice_inter_token_latency_seconds_count") ?? 0),
    running: total(scrape, "sluice_batch_current_size"),
    waiting: total(scrape, "sluice_queue_size"),
    kvUsed: total(scrape, "sluice_kv_cache_usage_ratio"),
    kvCached: capacity ? total(scrape, "sluice_kv_blocks_cached") / capacity : null,
    hitTokens: total(scrape, "sluice_prefix_cache_hit_tokens_total"),
    lookupTokens: total(scrape, "sluice_prefix_cache_lookup_tokens_total"),
    ttft: buckets(scrape, "sluice_time_to_first_token_seconds"),
    tpot: buckets(scrape, "sluice_inter_token_latency_seconds"),
    hourlyCost: total(scrape, "sluice_hourly_cost_dollars"),
    // The server's own figure over --cost-window-secs; absent while idle.
    costPerMillion: total(scrape, "sluice_cost_dollars_per_million_output_tokens"),
  };
}

const PERCENTILES = [0.5, 0.9, 0.99];

// What the tiles and charts show, from the newest sample, the one before it
// and the oldest one still inside the window.
function readingOf(now, previous, windowStart) {
  const seconds = previous ? now.t - previous.t : 0;
  const grown = previous ? now.tokens - previous.tokens : -1;
  const percentiles = (key) => PERCENTILES.map((q) => quantile(q, bucketGrowth(windowStart[key], now[key])));
  const looked = now.lookupTokens - windowStart.lookupTokens;
  return {
    tokensPerSecond: seconds > 0 && grown >= 0 ? grown / seconds : null,
    running: now.running,
    waiting: now.waiting,
    kvUsed: now.kvUsed,
    kvCached: now.kvCached,
    hitRate: looked > 0 ? (now.hitTokens - windowStart.hitTokens) / looked : null,
    ttft: percentiles("ttft"),
    tpot: percentiles("tpot"),
    hourlyCost: now.hourlyCost,
    costPerMillion: now.costPerMillion,
  };
}

// Text for a value; "–" where there is none (no traffic in the window).
const number = (v, digits = 1) => (v === null ? "–" : v.toFixed(digits));
const percent = (v) => (v === null ? "–" : v === 0 ? "0%" : `${(v * 100).toFixed(v < 0.1 ? 1 : 0)}%`);
const millis = (v) =>
  v === null ? "–" : v === 0 ? "0 ms" : v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`;
const dollars = (v) => (v === null ? "–" : v === 0 ? "$0" : `$${v.toFixed(v < 1 ? 3 : v < 100 ? 2 : 0)}`);

const TILES = [
  { id: "tok-s", label: "Output tokens/s", value: (r) => number(r.tokensPerSecond) },
  { id: "running", label: "Running", value: (r) => number(r.running, 0) },
  { id: "waiting", label: "Waiting", value: (r) => number(r.waiting, 0) },
  { id: "kv", label: "KV cache used", value: (r) => percent(r.kvUsed), note: (r) => `${percent(r.kvCached)} cached prefixes` },
  { id: "hit", label: "Prefix-cache hit rate", value: (r) => percent(r.hitRate) },
  { id: "ttft", label: "Time to first token", value: (r) => millis(r.ttft[0]), note: (r) => `p90 ${millis(r.ttft[1])} · p99 ${millis(r.ttft[2])}` },
  { id: "tpot", label: "Time per output token", value: (r) => millis(r.tpot[0]), note: (r) => `p90 ${millis(r.tpot[1])} · p99 ${millis(r.tpot[2])}` },
  {
    id: "cost",
    label: "$ per 1M output tokens",
    value: (r) => dollars(r.costPerMillion),
    note: (r) => (r.hourlyCost === null ? "start with --hourly-cost to see it" : `at ${dollars(r.hourlyCost)}/hour`),
  },
];

const CHARTS = [
  { id: "chart-tok-s", title: "Output tokens per second", series: [{ label: "tok/s", color: "--c1" }],
    format: (v) => number(v, v === 0 || v >= 10 ? 0 : 1), values: (r) => [r.tokensPerSecond] },
  { id: "chart-requests", title: "Requests", integer: true, series: [{ label: "running", color: "--c1" }, { label: "waiting", color: "--c2" }],
    format: (v) => number(v, 0), values: (r) => [r.running, r.waiting] },
  { id: "chart-kv", title: "KV cache", max: 1, series: [{ label: "used", color: "--c1" }, { label: "cached prefixes", color: "--c3" }],
    format: percent, values: (r) => [r.kvUsed, r.kvCached] },
  { id: "chart-hit", title: "Prefix-cache hit rate", max: 1, series: [{ label: "hit rate", color: "--c1" }],
    format: percent, values: (r) => [r.hitRate] },
  { id: "chart-ttft", title: "Time to first token", series: [{ label: "p50", color: "--c1" }, { label: "p99", color: "--c2" }],
    format: millis, values: (r) => [r.ttft[0], r.ttft[2]] },
  { id: "chart-tpot", title: "Time per output token", series: [{ label: "p50", color: "--c1" }, { label: "p99", color: "--c2" }],
    format: millis, values: (r) => [r.tpot[0], r.tpot[2]] },
  { id: "chart-cost", title: "$ per 1M output tokens", series: [{ label: "$/1M tokens", color: "--c1" }],
    format: dollars, values: (r) => [r.costPerMillion] },
];

export class Dashboard {
  constructor(root) {
    this.root = root;
    this.status = root.querySelector("#dashboard-status");
    this.samples = [];
    this.timer = null;
    this.infoText = "";
    root.querySelector("#window-seconds").textContent = String(WINDOW_S);
    this.tiles = this.buildTiles(root.querySelector("#tiles"));
    this.charts = this.buildCharts(root.querySelector("#charts"));
  }

  buildTiles(container) {
    return TILES.map((tile) => {
      const value = element("p", "value", "–");
      const note = element("p", "note");
      const box = element("div", "tile");
      box.id = `tile-${tile.id}`;
      box.append(element("p", "label", tile.label), value, note);
      container.append(box);
      return { tile, value, note };
    });
  }

  buildCharts(container) {
    return CHARTS.map((spec) => {
      const legend = element("ul", "legend");
      legend.append(...spec.series.map((s) => element("li", `swatch ${s.color.slice(2)}`, s.label)));
      const caption = element("figcaption", "", spec.title);
      caption.append(legend);
      const canvas = element("canvas");
      canvas.id = spec.id;
      const figure = element("figure", "chart");
      figure.append(caption, canvas);
      container.append(figure);
      return { spec, chart: new LineChart(canvas, spec) };
    });
  }

  // Polls while the dashboard is shown and the page is visible.
  show(visible) {
    this.visible = visible;
    if (visible && this.timer === null) this.poll();
  }

  async poll() {
    this.timer = "polling";
    try {
      await Promise.all([this.scrape(), this.refreshInfo()]);
    } catch (error) {
      this.status.textContent = `Cannot reach the server: ${error.message}`;
    }
    this.timer = this.visible && document.visibilityState === "visible" ? setTimeout(() => this.poll(), POLL_MS) : null;
  }

  async scrape() {
    const response = await request("/metrics");
    if (!response.ok) return this.refused(response);
    const now = sampleOf(parseMetrics(await response.text()), performance.now() / 1000);
    const previous = this.samples.at(-1);
    this.samples.push(now);
    while (this.samples[0].t < now.t - WINDOW_S) this.samples.shift();
    this.render(readingOf(now, previous, this.samples[0]), now.t);
    this.status.textContent = `Updated ${new Date().toLocaleTimeString()}`;
  }

  async refused(response) {
    this.status.textContent = `Metrics unavailable (${await errorMessage(response)})`;
    if (response.status === 401 && !this.root.querySelector("#enter-key")) {
      const button = element("button", "", "Enter API key");
      button.id = "enter-key";
      button.type = "button";
      button.onclick = async () => {
        if (await promptForKey()) button.remove();
      };
      this.status.after(button);
    }
  }

  render(reading, t) {
    for (const { tile, value, note } of this.tiles) {
      value.textContent = tile.value(reading);
      note.textContent = tile.note ? tile.note(reading) : "";
    }
    for (const { spec, chart } of this.charts) chart.push(t, spec.values(reading));
  }

  async refreshInfo() {
    const response = await request("/info");
    if (!response.ok) return;
    const text = await response.text();
    if (text === this.infoText) return;
    this.infoText = text;
    renderInfo(this.root.querySelector("#info"), JSON.parse(text));
  }
}

// /info as a definition list, every field in the server's order (nested ones
// as "speculation: method"), so settings other branches add show up unasked.
export function renderInfo(list, info, prefix = "") {
  if (!prefix) list.replaceChildren();
  for (const [key, value] of Object.entries(info)) {
    const name = `${prefix}${key.replaceAll("_", " ")}`;
    if (value !== null && typeof value === "object" && !Array.isArray(value)) {
      renderInfo(list, value, `${name}: `);
      continue;
    }
    const text = value === null ? "–" : Array.isArray(value) ? value.join(", ") : String(value);
    list.append(element("dt", "", name), element("dd", "", text));
  }
}
