#!/usr/bin/env python3
"""Prints markdown tables from criterion's estimates (target/criterion) of the
paths suite: medians, and each path's ratio to plain TCP in the same run.
A cell below 0.95x TCP throughput or above 1.05x its latency is marked SLOWER."""
import json
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion")


def median_ns(group, fn, param):
    p = root / group / fn / param / "new" / "estimates.json"
    if not p.exists():
        return None
    return json.loads(p.read_text())["median"]["point_estimate"]


def rr():
    paths = ["tcp", "tcp_not_covered", "redirect_mirror", "redirect_adaptive", "redirect_capture", "unix"]
    print("| size | " + " | ".join(paths) + " |")
    print("|---:|" + "---:|" * len(paths))
    for size in ["64", "1024", "16384", "65536", "1048576"]:
        base = median_ns("rr", "tcp", size)
        cells = []
        for p in paths:
            m = median_ns("rr", p, size)
            if m is None or base is None:
                cells.append("-")
                continue
            ratio = m / base
            flag = " SLOWER" if ratio > 1.05 and p != "tcp" and p != "unix" else ""
            cells.append(f"{m / 1000:.1f} us ({ratio:.2f}x){flag}")
        print(f"| {size} B | " + " | ".join(cells) + " |")


def stream():
    print("| connections x write, Nagle | tcp (not covered) | always | adaptive | always / tcp | adaptive / tcp |")
    print("|---|---:|---:|---:|---:|---:|")
    for write in ["64", "1024", "16384", "65536"]:
        mib = 4.0 if int(write) < 1024 else 32.0  # MiB per iteration
        for conns in ["1", "8", "64"]:
            for nagle in ["nodelay", "nagle"]:
                g = f"{conns}x{write}B_{nagle}"
                t = median_ns("stream", g, "tcp_not_covered")
                a = median_ns("stream", g, "redirect_always")
                d = median_ns("stream", g, "redirect_adaptive")
                if t is None or a is None or d is None:
                    continue
                tt, ta, td = (mib / (x / 1e9) for x in (t, a, d))
                cells = []
                for v in (ta, td):
                    flag = " SLOWER" if v < 0.95 * tt else ""
                    cells.append(f"{v / tt:.2f}x{flag}")
                print(f"| {conns} x {write} B, {nagle} | {tt:.0f} MiB/s | {ta:.0f} MiB/s | {td:.0f} MiB/s | "
                      + " | ".join(cells) + " |")


def control():
    for fn in ["insert_1000_single", "insert_1000_batch"]:
        p = root / "control" / fn / "new" / "estimates.json"
        if p.exists():
            m = json.loads(p.read_text())["median"]["point_estimate"]
            print(f"| {fn} | {m / 1e6:.2f} ms | {1000 / (m / 1e9):.0f} pairs/s |")


print("### Request/response round trip (median, ratio to plain TCP)\n")
rr()
print("\n### One-way bulk throughput (median)\n")
stream()
print("\n### Registering 1 000 pairs through the library\n")
print("| operation | time | rate |\n|---|---:|---:|")
control()
