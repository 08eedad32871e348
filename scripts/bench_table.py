#!/usr/bin/env python3
"""Prints markdown tables from criterion's estimates (target/criterion) of the
paths suite: medians, and each path's ratio to plain TCP in the same run.
A ratio on the wrong side of 1.0 is marked SLOWER."""
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
    paths = ["tcp", "tcp_not_covered", "redirect_mirror", "redirect_capture", "unix"]
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
            flag = " SLOWER" if ratio > 1.0 and p != "tcp" and p != "unix" else ""
            cells.append(f"{m / 1000:.1f} us ({ratio:.2f}x){flag}")
        print(f"| {size} B | " + " | ".join(cells) + " |")


def stream():
    print("| connections x write, Nagle | tcp (not covered) | redirect (mirror) | ratio |")
    print("|---|---:|---:|---:|")
    for conns in ["1", "8", "64"]:
        for nagle in ["nodelay", "nagle"]:
            g = f"{conns}x1024B_{nagle}"
            a = median_ns("stream", g, "tcp_not_covered")
            b = median_ns("stream", g, "redirect_mirror")
            if a is None or b is None:
                continue
            mib = 32.0  # bytes per iteration: 32 MiB
            ta, tb = mib / (a / 1e9), mib / (b / 1e9)
            flag = " SLOWER" if tb < ta else ""
            print(f"| {conns} x 1 KiB, {nagle} | {ta:.0f} MiB/s | {tb:.0f} MiB/s | {tb / ta:.2f}x{flag} |")


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
