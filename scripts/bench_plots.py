#!/usr/bin/env python3
"""Draws the benchmark page's plots (benches/plots/*.svg) from the benches' own output.

- throughput.svg: criterion's `by_key_count_u64` group (target/criterion/...): million
  checks a second per thread, tollgate against governor, by key count, on 1 and 2 threads;
- growth_cdf.svg: the growth probe's latency distributions (cdf-*.csv, written under
  $TOLLGATE_BENCH_OUT by `cargo bench`): a new key's first check and an existing key's
  check while the tables grow to 2M keys, tollgate against governor;
- sync_fault.svg: `sync_sim`'s admissions over time (docs/sync_sim.csv): what all nodes
  admit per second, bucket by bucket, against the limit, with Redis paused for 5 s.

Usage: scripts/bench_plots.py [criterion dir] [probe output dir]
(defaults: target/criterion and target/bench-out). Needs only Python 3's standard library.
"""

import csv
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benches", "plots")
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
W, H, L, R, T, B = 640, 400, 70, 170, 40, 50


def svg(path, title, xlabel, ylabel, series, xticks, yticks, xmap, ymap, hlines=()):
    """Writes a line chart: `series` is [(label, [(x, y)...], dashed)], the ticks
    [(value, label)], `xmap`/`ymap` map data to [0, 1]."""
    pw, ph = W - L - R, H - T - B
    px = lambda x: L + xmap(x) * pw
    py = lambda y: T + (1 - ymap(y)) * ph
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="{T - 15}" font-size="14">{title}</text>',
           f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for value, label in xticks:
        x = px(value)
        out.append(f'<line x1="{x:.1f}" y1="{T}" x2="{x:.1f}" y2="{T + ph}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{T + ph + 16}" text-anchor="middle">{label}</text>')
    for value, label in yticks:
        y = py(value)
        out.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{L - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for value, label in hlines:
        y = py(value)
        out.append(f'<line x1="{L}" y1="{y:.1f}" x2="{L + pw}" y2="{y:.1f}" stroke="#555" '
                   f'stroke-dasharray="2,3"/><text x="{L + pw - 4}" y="{y - 4:.1f}" '
                   f'text-anchor="end" fill="#555">{label}</text>')
    out.append(f'<text x="{L + pw / 2}" y="{H - 10}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text transform="translate(16,{T + ph / 2}) rotate(-90)" '
               f'text-anchor="middle">{ylabel}</text>')
    for i, (label, points, dashed) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        path_d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        dash = ' stroke-dasharray="6,4"' if dashed else ""
        out.append(f'<polyline points="{path_d}" fill="none" stroke="{colour}" '
                   f'stroke-width="2"{dash}/>')
        ly = T + 14 + 18 * i
        out.append(f'<line x1="{L + pw + 10}" y1="{ly - 4}" x2="{L + pw + 34}" y2="{ly - 4}" '
                   f'stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{L + pw + 40}" y="{ly}">{label}</text>')
    out.append("</svg>\n")
    with open(path, "w") as f:
        f.write("\n".join(out))
    print(f"bench_plots: wrote {os.path.relpath(path, ROOT)}")


def log_map(lo, hi):
    return lambda v: (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))


def throughput(criterion):
    group = os.path.join(criterion, "by_key_count_u64")
    series = []
    for name in ["tollgate", "governor"]:
        for threads in [1, 2]:
            points = []
            for keys in [1_000, 10_000, 100_000, 1_000_000]:
                est = os.path.join(group, name, f"{keys}_keys_{threads}_thread", "new",
                                   "estimates.json")
                if os.path.exists(est):
                    ns = json.load(open(est))["median"]["point_estimate"]
                    points.append((keys, 1_000.0 / ns))
            if points:
                series.append((f"{name}, {threads} thread{'s' * (threads > 1)}", points,
                               threads == 2))
    if not series:
        print(f"bench_plots: no by_key_count_u64 results under {criterion}; skipped")
        return
    top = max(y for _, pts, _ in series for _, y in pts) * 1.15
    svg(os.path.join(OUT, "throughput.svg"),
        "Checks per second per thread, token bucket, u64 keys", "keys in use",
        "million checks / s / thread", series,
        [(k, label) for k, label in [(1e3, "1k"), (1e4, "10k"), (1e5, "100k"), (1e6, "1M")]],
        [(v, f"{v:g}") for v in range(0, int(top) + 1, max(1, int(top) // 6))],
        log_map(1e3, 1e6), lambda v: v / top)


def nines(q):
    return -math.log10(max(1.0 - q, 1e-6))


def growth_cdf(probes):
    series = []
    for label, file, dashed in [
        ("tollgate, new key", "tollgate-fresh-2t-new", False),
        ("governor, new key", "governor-fresh-2t-new", False),
        ("tollgate, existing", "tollgate-fresh-2t-existing", True),
        ("governor, existing", "governor-fresh-2t-existing", True),
    ]:
        path = os.path.join(probes, f"cdf-{file}.csv")
        if not os.path.exists(path):
            continue
        rows = [(float(r["quantile"]), max(float(r["ns"]), 10.0)) for r in csv.DictReader(open(path))]
        series.append((label, [(ns, min(nines(q), 6.0)) for q, ns in rows], dashed))
    if not series:
        print(f"bench_plots: no growth distributions under {probes}; skipped")
        return
    hi = 10 ** math.ceil(math.log10(max(x for _, pts, _ in series for x, _ in pts)))
    svg(os.path.join(OUT, "growth_cdf.svg"),
        "Latency while the tables grow to 2M keys, 2 threads", "ns (log scale)", "percentile",
        series,
        [(10 ** e, f"{10 ** e:g}") for e in range(1, int(math.log10(hi)) + 1)],
        [(0, "p0"), (1, "p90"), (2, "p99"), (3, "p99.9"), (4, "p99.99"), (5, "p99.999"), (6, "max")],
        log_map(10, hi), lambda v: v / 6.0)


def sync_fault():
    path = os.path.join(ROOT, "docs", "sync_sim.csv")
    if not os.path.exists(path):
        print("bench_plots: no docs/sync_sim.csv (run the sync_sim example); skipped")
        return
    rows = [r for r in csv.DictReader(open(path)) if r["scenario"] == "2"]
    starts = sorted({int(r["bucket_start_ms"]) for r in rows})
    per_s = 1000.0 / (starts[1] - starts[0]) if len(starts) > 1 else 1.0
    series = []
    for mode in ["reconcile", "lease"]:
        pts = [(int(r["bucket_start_ms"]) / 1000.0, int(r["admitted"]) * per_s)
               for r in rows if r["mode"] == mode]
        if pts:
            series.append((mode, pts, mode == "lease"))
    if not series:
        return
    end = max(x for _, pts, _ in series for x, _ in pts)
    top = max(max(y for _, pts, _ in series for _, y in pts), 200) * 1.2
    svg(os.path.join(OUT, "sync_fault.svg"),
        "3 nodes, 200/s: Redis paused (SIGSTOP) from 3 s to 8 s", "seconds",
        "admitted / s (all nodes)", series,
        [(s, str(s)) for s in range(0, int(end) + 1, 2)],
        [(v, str(int(v))) for v in range(0, int(top) + 1, 100)],
        lambda v: v / end, lambda v: v / top, hlines=[(200, "limit 200/s")])


def main():
    criterion = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "criterion")
    probes = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "target", "bench-out")
    os.makedirs(OUT, exist_ok=True)
    throughput(criterion)
    growth_cdf(probes)
    sync_fault()


if __name__ == "__main__":
    main()
