"""A short text summary of `benchmarks/spec_verify_cost.py` result files, for the device
scripts (scripts/gpu_spec_ab.sh, scripts/gpu_verifyk.sh): per file its switches
(mq_merge, gemv_rows, and rope_verify in files of 2026-12-07 and before) in its header line, the verify and plain step
times (wall and GPU ms; a verify row's break-even acceptance length), the host part's rows,
the kernel profile's top kernels and the replay drafter's end-to-end points (with their step
kinds, benchmarks/spec_step_kinds.py).

Usage: python3 benchmarks/spec_verify_summary.py FILE.json [FILE.json ...] (a missing file
prints "no result"; nothing is raised for one with parts left out).
"""

from __future__ import annotations

import json
import os
import sys


def summarize(path: str) -> list[str]:
    """The summary lines of one result file (module doc)."""
    if not os.path.exists(path):
        return [f"== {os.path.basename(path)}: no result"]
    r = json.load(open(path))
    mq = f" mq_merge={r['mq_merge']}" if "mq_merge" in r else ""
    mq += f" gemv_rows={r['gemv_rows']}" if "gemv_rows" in r else ""
    mq += f" rope_verify={r['rope_verify']}" if "rope_verify" in r else ""
    out = [f"== {os.path.basename(path)} complete={r.get('complete')}{mq}"]
    for x in r.get("verify_cost", []):
        gpu = f", {x['gpu_ms']} ms gpu" if x.get("gpu_ms") is not None else ""
        extra = f", break-even L {x['break_even_L']}" if x.get("mode") == "verify" else ""
        out.append(f"  b={x['batch']} k={x.get('k')} {x.get('mode')}: {x['wall_ms']:.3f} ms wall{gpu}{extra}")
    for x in (r.get("host_cost") or {}).get("rows", []):
        for m in ("decode", "verify_fast", "verify_full"):
            y = x.get(m)
            if y:
                out.append(f"  host b={x['batch']} {m}: wall {y['wall_ms']:.3f} ms, outside the forward "
                           f"{y['outside_ms']:.3f} ms (before {y['before_forward_ms']:.3f}, after the read "
                           f"{y['after_last_read_ms']:.3f}), {y['aten_ops_outside']} ops, {y['host_reads']} reads")
        if "identical" in x:
            out.append(f"  host b={x['batch']}: identical {x['identical']}, saved {x.get('outside_ms_saved')} ms")
    pr = r.get("profile")
    for part in ("decode", "verify") if pr else ():
        out.append(f"  profile {part}: {pr[part]['total_us']} us of kernels a step; top:")
        out += [f"    {x['us']:8.1f} us x{x['calls']:3d} {x['kernel']}" for x in pr[part]["top"][:10]]
    e = r.get("e2e_replay")
    if e:
        out.append(f"  e2e plain {e['plain']['output_tok_per_s']} tok/s")
        out += _kinds(e["plain"])
        for q in e["points"]:
            ref = (f", on reference {q['on_reference']} ({q['reference_rounds']} rounds), off track "
                   f"{q['off_track_proposals']}" if "on_reference" in q else "")
            out.append(f"  e2e L={q['measured_L']}: {q['output_tok_per_s']} tok/s, speedup {q['speedup']}, "
                       f"efficiency {q['efficiency']}, identical {q['identical']}{ref}")
            out += _kinds(q)
    return out


def _kinds(run: dict) -> list[str]:
    """One line per step kind of a run's `step_kinds` (benchmarks/spec_step_kinds.py)."""
    out = []
    for kind, x in (run.get("step_kinds") or {}).items():
        if kind == "total":
            out.append(f"    all {x['steps']} steps: {x['wall_ms']:.2f} ms in execute, host idle "
                       f"{x['idle_host_ms']:.2f} ms")
            continue
        dev = f", device {x['device_ms_median']:.3f}" if x.get("device_ms_median") is not None else ""
        gap = f", gap {x['gap_before_ms_median']:.3f}" if x.get("gap_before_ms_median") is not None else ""
        out.append(f"    {kind}: {x['steps']} x {x['wall_ms_median']:.3f} ms (total {x['wall_ms_total']:.2f}){dev}, "
                   f"before fwd {x['before_forward_ms_median']:.3f}, after read {x['after_last_read_ms_median']:.3f}"
                   f"{gap}")
    return out


def main(argv: list[str]) -> None:
    for p in argv:
        print("\n".join(summarize(p)))


if __name__ == "__main__":
    main(sys.argv[1:])
