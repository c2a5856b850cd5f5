// How the run viewer shows numbers and tells series apart: table and axis formats that
// stay readable for values of any size, and a palette of as many distinguishable colours
// as there are sessions or runs. Loaded before app.js, which uses these.
"use strict";

// The first colours of every palette; `palette(n)` adds more for n past ten.
const BASE_COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2",
                      "#ca8a04", "#db2777", "#4b5563", "#65a30d"];

// A number in a table: `digits` decimals, or scientific notation where those would leave
// at most one significant digit (a KL of 3e-5 reads 3.00e-5, not 0.000) or the number is huge.
function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const size = Math.abs(v);
  if (size < 10 ** (1 - digits) || size >= 1e9) return v.toExponential(digits - 1);
  return v.toFixed(digits);
}

// A number on an axis or in a tooltip: `digits` significant digits (whole numbers past
// them are rounded, not cut), scientific below 1e-3 and from 1e6 up; 0 (and -0) as "0".
function sig(v, digits = 3) {
  if (v === 0) return "0";
  const size = Math.abs(v);
  if (size < 1e-3 || size >= 1e6) return v.toExponential(digits - 1);
  if (size >= 10 ** digits) return String(Math.round(v));
  return String(Number(v.toPrecision(digits)));
}

// Labels for axis values: the fewest significant digits (3 or more) that tell them apart.
function axisLabels(values) {
  const distinct = new Set(values).size;
  for (let digits = 3; digits < 12; digits++) {
    const labels = values.map(v => sig(v, digits));
    if (new Set(labels).size === distinct) return labels;
  }
  return values.map(v => String(v));
}

// `n` colours, one per session or run, as far apart as a grid of saturated colours allows:
// the base ten first, then each next the candidate farthest (CIELAB distance) from all
// those chosen. The same n gives the same colours, in the same order.
function palette(n) {
  const chosen = BASE_COLOURS.slice(0, n).map(hex => ({ hex, lab: lab(hexRGB(hex)) }));
  if (chosen.length >= n) return chosen.map(c => c.hex);
  const candidates = [];
  for (let hue = 0; hue < 360; hue += 8)
    for (const light of [30, 42, 54])  // dark enough to read on white
      for (const sat of [85, 55]) candidates.push(hslHex(hue, sat, light));
  const pool = candidates.map(hex => ({ hex, lab: lab(hexRGB(hex)),
    nearest: Math.min(...chosen.map(c => labDistance(lab(hexRGB(hex)), c.lab))) }));
  while (chosen.length < n) {
    const best = pool.reduce((a, b) => (b.nearest > a.nearest ? b : a));
    chosen.push(best);
    for (const c of pool) c.nearest = Math.min(c.nearest, labDistance(c.lab, best.lab));
  }
  return chosen.map(c => c.hex);
}

function hslHex(hue, sat, light) {
  const s = sat / 100, l = light / 100, a = s * Math.min(l, 1 - l);
  const channel = k => {
    const m = (k + hue / 30) % 12;
    return Math.round(255 * (l - a * Math.max(-1, Math.min(m - 3, 9 - m, 1))));
  };
  return "#" + [0, 8, 4].map(k => channel(k).toString(16).padStart(2, "0")).join("");
}

const hexRGB = hex => [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16));

function lab([r, g, b]) {
  // sRGB (D65) to CIELAB.
  const linear = c => { c /= 255; return c <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
  const [R, G, B] = [r, g, b].map(linear);
  const xyz = [(0.4124 * R + 0.3576 * G + 0.1805 * B) / 0.95047,
               0.2126 * R + 0.7152 * G + 0.0722 * B,
               (0.0193 * R + 0.1192 * G + 0.9505 * B) / 1.08883];
  const f = t => (t > 216 / 24389 ? Math.cbrt(t) : (24389 / 27 * t + 16) / 116);
  const [fx, fy, fz] = xyz.map(f);
  return [116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)];
}

const labDistance = (p, q) => Math.hypot(p[0] - q[0], p[1] - q[1], p[2] - q[2]);
