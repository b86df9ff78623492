// A small line chart on <canvas>: a few series over the last `span` seconds,
// drawn from zero up to a rounded maximum, redrawn on every new point and on
// resize. No library: the page must work without a network.
//
// The canvas is an image to assistive technology (role="img"); its label says
// what is drawn and the latest values, which the tiles above also show as text.
// `data-points` and `data-latest` let tests see it update.

export class LineChart {
  // series: [{label, color}] (color: a CSS custom property name, so the chart
  // follows the light/dark theme); format: value -> text for the axis and label;
  // max: a fixed top of the axis (a ratio's 1), else it follows the data;
  // integer: the values are counts, so the axis' middle line must be one too.
  constructor(canvas, { title, series, format, max = null, integer = false, span = 120 }) {
    Object.assign(this, { canvas, title, series, format, max, integer, span });
    this.points = []; // [{t (seconds), values: [number|null per series]}]
    canvas.setAttribute("role", "img");
    new ResizeObserver(() => this.draw()).observe(canvas);
    this.describe();
  }

  push(t, values) {
    this.points.push({ t, values });
    while (this.points.length && this.points[0].t < t - this.span) this.points.shift();
    this.canvas.dataset.points = String(this.points.length);
    this.canvas.dataset.latest = JSON.stringify(values);
    this.describe();
    this.draw();
  }

  describe() {
    const last = this.points.at(-1);
    const now = last
      ? this.series.map((s, i) => `${s.label} ${last.values[i] === null ? "no data" : this.format(last.values[i])}`).join(", ")
      : "no data yet";
    this.canvas.setAttribute("aria-label", `${this.title}, last ${this.span / 60} minutes: ${now}`);
  }

  draw() {
    const { canvas } = this;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return; // hidden (another tab)
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    const style = getComputedStyle(canvas);
    const color = (name) => style.getPropertyValue(name).trim() || "#888";
    g.font = `12px ${style.fontFamily}`;
    const top = this.axisTop();
    const plot = { left: g.measureText(this.format(top)).width + 10, right: width - 6, top: 8, bottom: height - 18 };
    this.drawGrid(g, plot, top, color);
    const end = this.points.length ? this.points.at(-1).t : 0;
    const x = (t) => plot.right - ((end - t) / this.span) * (plot.right - plot.left);
    const y = (v) => plot.bottom - (Math.min(v, top) / top) * (plot.bottom - plot.top);
    g.lineWidth = 2;
    this.series.forEach((s, i) => {
      g.strokeStyle = color(s.color);
      g.beginPath();
      let drawing = false; // a null value breaks the line
      for (const p of this.points) {
        const v = p.values[i];
        if (v === null || !Number.isFinite(v)) {
          drawing = false;
          continue;
        }
        if (drawing) g.lineTo(x(p.t), y(v));
        else g.moveTo(x(p.t), y(v));
        drawing = true;
      }
      g.stroke();
    });
  }

  // The top of the y axis: the fixed max, else the data's max rounded up to
  // 1, 2 or 5 times a power of ten (so the labels are round numbers); even
  // for counts, whose middle line is then a whole number.
  axisTop() {
    if (this.max !== null) return this.max;
    let peak = 0;
    for (const p of this.points) for (const v of p.values) if (v !== null && Number.isFinite(v)) peak = Math.max(peak, v);
    if (this.integer) peak = Math.max(peak, 2);
    if (peak <= 0) return 1;
    const power = 10 ** Math.floor(Math.log10(peak));
    const steps = this.integer && power === 1 ? [2, 4, 6, 8, 10] : [1, 2, 5, 10];
    return steps.map((m) => m * power).find((top) => top >= peak);
  }

  drawGrid(g, plot, top, color) {
    g.strokeStyle = color("--grid");
    g.fillStyle = color("--muted");
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let k = 0; k <= 2; k++) {
      const value = (top * k) / 2;
      const y = plot.bottom - (k / 2) * (plot.bottom - plot.top);
      g.beginPath();
      g.moveTo(plot.left, y);
      g.lineTo(plot.right, y);
      g.stroke();
      g.fillText(this.format(value), plot.left - 4, y);
    }
    g.textAlign = "left";
    g.textBaseline = "alphabetic";
    g.fillText(`-${this.span / 60} min`, plot.left, plot.bottom + 15);
    g.textAlign = "right";
    g.fillText("now", plot.right, plot.bottom + 15);
  }
}
