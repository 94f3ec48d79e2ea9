"""Old tree against new tree: every timed figure of two result files of the same benchmark, row by row.

    python benchmarks/compare_runs.py OLD.json NEW.json [OLD2.json NEW2.json ...] [--out compare.json]

Rows are matched by their "case"; a figure is a number whose key names a time or a rate (`*_us`, `*_s`
per call, `*tok_s`, `tokens_per_s`). new / old is printed per figure, with the direction that is better
(lower for times, higher for rates); `worse_by` is how much worse the new tree is (0 when better).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMES = ("_us",)
RATES = ("tok_s", "tokens_per_s")


def figures(row: dict) -> dict[str, tuple[float, bool]]:
    """{key: (value, higher_is_better)} of one row's timed figures."""
    out = {}
    for key, value in row.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if key.endswith(TIMES) and "floor" not in key:
            out[key] = (float(value), False)
        elif key.endswith(RATES) and "floor" not in key:
            out[key] = (float(value), True)
    return out


def compare(old: dict, new: dict) -> list[dict]:
    by_case = {json.dumps(r.get("case"), sort_keys=True): r for r in old.get("rows", [])}
    out = []
    for row in new.get("rows", []):
        key = json.dumps(row.get("case"), sort_keys=True)
        before = by_case.get(key)
        if before is None:
            continue
        a, b = figures(before), figures(row)
        for name in sorted(set(a) & set(b)):
            (va, up), (vb, _) = a[name], b[name]
            if va <= 0:
                continue
            ratio = vb / va
            worse = max(0.0, (1 / ratio - 1) if up else (ratio - 1))
            out.append({"case": row.get("case"), "figure": name, "old": va, "new": vb, "new_over_old": ratio,
                        "worse_by": worse})  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="OLD NEW pairs")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if len(a.files) % 2:
        raise SystemExit(f"files: expected OLD NEW pairs, got {len(a.files)} paths")
    rows = []
    for old, new in zip(a.files[::2], a.files[1::2]):
        if not (Path(old).is_file() and Path(new).is_file()):
            print(f"{old} / {new}: missing, skipped")
            continue
        got = compare(json.loads(Path(old).read_text()), json.loads(Path(new).read_text()))
        for r in got:
            r["benchmark"] = Path(new).stem
            case = json.dumps(r["case"])
            print(f"{r['benchmark']:>14} {case:<55} {r['figure']:<32} {r['old']:>10.1f} {r['new']:>10.1f}  "
                  f"{r['new_over_old']:.3f}  worse {100 * r['worse_by']:.1f}%")  # fmt: skip
        rows += got
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
