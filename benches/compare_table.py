#!/usr/bin/env python3
"""Issue 4's comparison tables, in Markdown, from one run's logs.

Reads, from DIR:
  bench-tf32.json, bench-bf16.json    host bench ... --precision P --json FILE
  kernels-tf32.json, kernels-bf16.json  ALEXNET_BENCH_JSON=FILE kernels tf32|bf16
  pytorch.log                         benches/pytorch_reference.py ... --layers

and prints the training-step table (ours and PyTorch, images/s, with the
ratio) and the per-conv-layer table (batch 128 by default; ours in bold
where faster than cuDNN). Usage: python3 benches/compare_table.py DIR [--batch N]
"""

import argparse
import json
import re
import sys
from pathlib import Path

PRECISIONS = ("tf32", "bf16")
LABEL = {"tf32": "TF32", "bf16": "bf16"}
PRODUCTS = ("conv_forward", "conv_backward_data", "conv_backward_filter")
TORCH_PRODUCTS = ("fwd", "data-grad", "weight-grad")
LAYERS = tuple(f"conv{i}" for i in range(1, 6))


def ours_steps(d: Path):
    """{(precision, batch): (images/s, step ms)} from host bench's JSON."""
    out = {}
    for p in PRECISIONS:
        for row in json.loads((d / f"bench-{p}.json").read_text()):
            out[(p, row["batch"])] = (row["images_per_sec"], row["median_step_ms"])
    return out


def ours_layers(d: Path, batch: int):
    """{(precision, layer, product): ms} from the kernel benchmarks' JSON."""
    out = {}
    for p in PRECISIONS:
        for row in json.loads((d / f"kernels-{p}.json").read_text())["rows"]:
            layer, _, prec = row["case"].partition(" ")
            if row["batch"] == batch and prec == p and row["kernel"] in PRODUCTS:
                out[(p, layer, row["kernel"])] = row["median_ms"]
    return out


def torch_results(d: Path):
    """({(precision, batch): images/s}, {(precision, batch, layer): [ms × 3]})."""
    steps, layers = {}, {}
    step_re = re.compile(r"^\s*(tf32|bf16) batch\s+(\d+):\s+[\d.]+ ms\s+(\d+) img/s")
    layer_re = re.compile(
        r"^\s*(tf32|bf16) batch\s+(\d+)\s+(conv\d):\s+fwd ([\d.]+) ms\s+"
        r"data-grad ([\d.]+) ms\s+weight-grad ([\d.]+) ms"
    )
    for line in (d / "pytorch.log").read_text().splitlines():
        if m := step_re.match(line):
            steps[(m[1], int(m[2]))] = float(m[3])
        elif m := layer_re.match(line):
            layers[(m[1], int(m[2]), m[3])] = [float(m[i]) for i in (4, 5, 6)]
    return steps, layers


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--batch", type=int, default=128, help="batch of the per-layer table")
    a = ap.parse_args()
    try:
        steps = ours_steps(a.dir)
        layers = ours_layers(a.dir, a.batch)
        t_steps, t_layers = torch_results(a.dir)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"compare_table: {a.dir}: {e}")

    batches = sorted({b for (_, b) in steps})
    print("| images/s | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for p in PRECISIONS:
        cells = []
        for b in batches:
            ips, ms = steps.get((p, b), (None, None))
            cells.append("–" if ips is None else f"{ips:,.0f} ({ms:.2f} ms)")
        print(f"| ours, {LABEL[p]} | " + " | ".join(cells) + " |")
    for p in PRECISIONS:
        name = "TF32" if p == "tf32" else "bf16 autocast"
        cells = [f"{t_steps[(p, b)]:,.0f}" if (p, b) in t_steps else "–" for b in batches]
        print(f"| PyTorch + cuDNN, {name} | " + " | ".join(cells) + " |")
    for p in PRECISIONS:
        ratios = [
            f"batch {b}: {steps[(p, b)][0] / t_steps[(p, b)]:.2f}×"
            for b in batches
            if (p, b) in steps and (p, b) in t_steps
        ]
        print(f"\nours / PyTorch, {LABEL[p]}: " + ", ".join(ratios))

    print(f"\nPer conv layer, batch {a.batch}, ms, forward · data gradient · weight gradient:\n")
    print("| layer | ours TF32 | cuDNN TF32 | ours bf16 | cuDNN bf16 |")
    print("|---|---|---|---|---|")
    for layer in LAYERS:
        row = [layer]
        for p in PRECISIONS:
            theirs = t_layers.get((p, a.batch, layer))
            mine = []
            for i, k in enumerate(PRODUCTS):
                ms = layers.get((p, layer, k))
                if ms is None:
                    mine.append("–")
                    continue
                cell = f"{ms:.2f}"
                mine.append(f"**{cell}**" if theirs and ms < theirs[i] else cell)
            row.append(" · ".join(mine))
            row.append(" · ".join(f"{v:.2f}" for v in theirs) if theirs else "–")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
