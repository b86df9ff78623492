// Reading /metrics (the Prometheus text format, version 0.0.4) in the browser:
// the parser, and the two things the dashboard computes from scrapes: how much
// a counter grew between two scrapes, and a percentile from the growth of a
// histogram's buckets (what PromQL's histogram_quantile does).

// One scrape: series name -> [{labels, value}], in the order they came.
export function parseMetrics(text) {
  const series = new Map();
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (line === "" || line.startsWith("#")) continue;
    const sample = parseSample(line);
    if (!sample) continue;
    if (!series.has(sample.name)) series.set(sample.name, []);
    series.get(sample.name).push({ labels: sample.labels, value: sample.value });
  }
  return series;
}

// `name{label="value",...} number [timestamp]`; null for a line that is not one.
export function parseSample(line) {
  const name = /^[A-Za-z_:][A-Za-z0-9_:]*/.exec(line);
  if (!name) return null;
  let rest = line.slice(name[0].length);
  const labels = {};
  if (rest.startsWith("{")) {
    const label = /\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?\s*/y;
    let at = 1;
    for (;;) {
      label.lastIndex = at;
      const m = label.exec(rest);
      if (!m) break;
      labels[m[1]] = m[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      at = label.lastIndex;
    }
    if (rest[at] !== "}") return null;
    rest = rest.slice(at + 1);
  }
  const token = rest.trim().split(/\s+/)[0];
  const value = parseNumber(token);
  if (Number.isNaN(value) && token !== "NaN") return null;
  return { name: name[0], labels, value };
}

function parseNumber(text) {
  if (text === "+Inf" || text === "Inf") return Infinity;
  if (text === "-Inf") return -Infinity;
  return text === "" ? NaN : Number(text);
}

// The sum over every label set of a series; null when the scrape lacks it.
export function total(scrape, name) {
  const samples = scrape.get(name);
  return samples ? samples.reduce((sum, s) => sum + s.value, 0) : null;
}

// A histogram's cumulative buckets, summed over its label sets:
// [{le, count}] by ascending bound, the last one +Inf.
export function buckets(scrape, name) {
  const byBound = new Map();
  for (const { labels, value } of scrape.get(`${name}_bucket`) ?? []) {
    const le = parseNumber(labels.le);
    byBound.set(le, (byBound.get(le) ?? 0) + value);
  }
  return [...byBound].map(([le, count]) => ({ le, count })).sort((a, b) => a.le - b.le);
}

// How much each bucket grew from `before` to `after` (a server restart, which
// resets counters, counts from zero).
export function bucketGrowth(before, after) {
  const old = new Map(before.map((b) => [b.le, b.count]));
  const restarted = after.some((b) => b.count < (old.get(b.le) ?? 0));
  return after.map((b) => ({ le: b.le, count: restarted ? b.count : b.count - (old.get(b.le) ?? 0) }));
}

// The q-quantile (0 < q < 1) of the observations in cumulative `buckets`,
// interpolated linearly inside the bucket it falls in; null without
// observations. A quantile in the +Inf bucket is the highest finite bound: all
// that is known is that it is above it.
export function quantile(q, cumulative) {
  const count = cumulative.length ? cumulative[cumulative.length - 1].count : 0;
  if (count <= 0) return null;
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const { le, count: upTo } of cumulative) {
    if (upTo >= rank && upTo > below) {
      if (le === Infinity) return lower;
      return lower + ((le - lower) * (rank - below)) / (upTo - below);
    }
    if (le !== Infinity) lower = le;
    below = upTo;
  }
  return lower;
}
