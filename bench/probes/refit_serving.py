"""Refit a profile's stored serving calibration (`serving.rows`) with sim/calibrate.py's current
row model, without measuring again, and write the profile with the new coefficients: for trying
a change to the model on a calibration already taken. Decode rows are rebuilt from their level
(batch, solo or not) and measured y; the probes' rate per level is inferred from the level's
stored probe rows (calibration: 12 s levels, two rounds, unless told otherwise).

Run: .venv/bin/python bench/probes/refit_serving.py PROFILE OUT [--seconds 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sim.calibrate import Row, decode_row, describe, fit_serving, probing_seconds  # noqa: E402
from sim.profile import Profile  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile")
    p.add_argument("out")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the N-replica levels")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--out-len", type=int, default=48)
    args = p.parse_args()
    prof = Profile.load(args.profile)
    serving = prof.serving
    replicas = serving["replicas"]
    stored = serving["rows"]
    probes = collections.Counter(r["level"] for r in stored if r["group"] == "probe")
    probing_s = probing_seconds(args.seconds)
    rows = []
    for r in stored:
        if r["group"] != "decode":
            rows.append(Row.of_dict(r))
            continue
        solo = r["level"].endswith(" solo")
        batch = int(r["level"][2:].split()[0])
        rounds, n = (1, 1) if solo else (args.rounds, replicas)
        rate = probes[r["level"]] / rounds / probing_s / n
        rows.append(
            decode_row(
                prof.model, batch, args.prompt_len, args.out_len, r["y"], 0.0 if solo else 1.0, rate
            )
        )
    print("stored:", describe(serving))
    new = fit_serving(rows)
    for g, e in new["fit_error"].items():
        print(
            f"  {g:8s} n={e['n']:4d} median error {e['median_abs_rel_error']:.1%} bias {e['bias']:+.1%}"
        )
    for w in new["warnings"]:
        print("  warning:", w)
    print("refit: ", describe(new))
    keep = {k: v for k, v in serving.items() if k not in new}
    rebuilt = [r.as_dict() for r in rows]
    prof.serving = {**keep, **new, "rows": rebuilt, "refit": "bench/probes/refit_serving.py"}
    prof.save(args.out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
