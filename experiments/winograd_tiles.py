"""Issue 40 item 2: Winograd's tile size predicted from the bound (maco.bounds.winograd.predict_tile,
from this host's FMA peak, its DRAM read bandwidth and the share of the peak each tile size's
multiplies reach on a reference conv) against the tile size timing picks, on every
distinct 3x3 and 5x5 stride-1 conv of ResNet-18, AlexNet, VGG-11, ResNet-50 and MobileNetV2 at
batch 1 (MobileNetV2 has none: its 3x3 convs are depthwise or strided).

The timed choice is the one `maco optimize` makes (deploy.kernel_choice.with_winograd): each tile
size's kernel (layouts.maco_modules.MacoWinograd2d, NHWC) called with its transformed filters
and input dropped from the caches first (kernels.cache_flush), as inside a model, where the
transformed filters come from DRAM; both tile sizes in the same
interleaved rounds, the faster by the median of per-round ratios; then timed again, in rounds of
their own, to show how often timing repeats its own choice (a ceiling on any model's agreement).
The peak and the bandwidth are measured in this process first (kernels.cpu_peak.measure_ceilings:
this host's best), then the tile sizes' ceilings (kernels.cpu_peak.winograd_ceilings, on convs
none of the networks has). The model predicts twice: with the best bandwidth (`predicted`), and
with the DRAM reads timed beside each conv's timings (`predicted_now`, the median of reads
before, between and after them): on a VM whose memory another tenant shares, a short read pass
measures less than the kernels' prefetched streams get, and it predicted no better than the best
(docs/bounds.md).

    flock /tmp/maco-timing.lock python experiments/winograd_tiles.py --out results

Writes winograd_tiles.csv and .env.json under --out.
"""
from __future__ import annotations

import statistics
import sys
from typing import Any

import torch
from torch import nn

from maco import kernels
from maco.bounds.network import tile_label
from maco.bounds.winograd import predict_tile
from maco.core.timing import interleaved_rounds, steady_allocator
from maco.experiments.common import Figure, num, out_dir, parser, write_csv, write_env
from maco.kernels.cache_flush import Flush
from maco.kernels.cpu_peak import dram_bytes_per_core, measure_ceilings, read_bandwidth, winograd_ceilings
from maco.kernels.winograd import TILE_SIZES
from maco.layouts.maco_modules import MacoWinograd2d, winograd_module_can_run
from maco.layouts.networks import distinct_convs, network_convs

FIGURE = Figure(
    "winograd_tiles", "(not in the paper) Winograd's tile size predicted from the bound against timing",
    "the model prices F(m x m) as its multiplies at the share of the FMA peak the tile size reaches (timed "
    "once per host on a reference conv) or its traffic with the transformed filters from DRAM, whichever "
    "takes longer (the kernel streams U under its multiplies); timing "
    "drops each kernel's filters and input from the caches before each call, as a model's call finds them "
    "(runs on 2026-11-28 and before swept a buffer twice the largest cache instead)",
    csv=("winograd_tiles*.csv",))

NETWORKS = "resnet18,alexnet,vgg11,resnet50,mobilenet_v2"
TIE = 0.05  # tile sizes timed closer than this are a coin flip on a shared VM (results/label_repeat.csv)


def time_tiles(spec: Any, target: Any, rounds: int) -> dict[int, float]:
    """{m: median seconds} of each tile size's kernel, its U and x flushed before every call, and the
    median per-round ratio F(2)/F(m) under key -m (how much faster m is than the smallest)."""
    conv = nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation,
                     spec.groups, bias=False).eval()
    x = torch.randn(spec.input_shape, generator=torch.Generator().manual_seed(0)).contiguous(
        memory_format=torch.channels_last)
    mods = {m: MacoWinograd2d(conv, spec, target, m=m) for m in TILE_SIZES[spec.kh]}
    with torch.inference_mode():
        for mod in mods.values():
            mod(x)
        timed = interleaved_rounds({m: (lambda mod=mod: mod(x)) for m, mod in mods.items()}, rounds,
                                   repeats=3, min_run_time=5e-3, warmup=2, before=Flush(*mods.values(), x))
    first = min(mods)
    out: dict[int, float] = {m: statistics.median(t.min for t in ts) for m, ts in timed.items()}
    for m in mods:
        out[-m] = statistics.median(a.min / b.min for a, b in zip(timed[first], timed[m]))
    return out


def reads_now(target: Any) -> float:
    """DRAM read bandwidth now, bytes/s (one short pass: kernels.cpu_peak.read_bandwidth)."""
    return 4 * read_bandwidth(target, dram_bytes_per_core(target), seconds=0.05, repeats=2)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--networks", default=NETWORKS)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    out = out_dir(args)
    target = kernels.host_target()
    torch.set_num_threads(target.cores)
    steady_allocator()
    ceilings = measure_ceilings(target, 5)
    peak, bw = ceilings["fma_gflops_best"] * 1e9, ceilings["read_gbs_best"] * 1e9
    print(f"{target.model}, {target.cores} cores: FMA peak {peak / 1e9:.1f} GFLOP/s, DRAM reads {bw / 1e9:.1f} GB/s "
          f"(this host's best; now {ceilings['fma_gflops']:.1f} and {ceilings['read_gbs']:.1f})", flush=True)
    shares = winograd_ceilings(target, args.rounds)
    print("Winograd's multiplies reach " + ", ".join(f"{tile_label(m, r)} {100 * e:.0f}%" for (m, r), e in shares.items())
          + " of the FMA peak", flush=True)
    rows, seen = [], set()
    for net in args.networks.split(","):
        for spec, names in distinct_convs(network_convs(net, 1)):
            conv = nn.Conv2d(spec.c, spec.k, (spec.kh, spec.kw), spec.stride, spec.padding, spec.dilation, spec.groups)
            if spec in seen or not winograd_module_can_run(conv, spec, target):
                continue
            seen.add(spec)
            predicted, model_s = predict_tile(spec, peak, bw, shares)
            reads = [reads_now(target)]
            t = time_tiles(spec, target, args.rounds)
            reads.append(reads_now(target))
            again = time_tiles(spec, target, args.rounds)
            bw_now = statistics.median(reads + [reads_now(target)])
            predicted_now, _ = predict_tile(spec, peak, bw_now, shares)
            sizes = [m for m in t if m > 0]
            # each timing's pick: the largest speedup over the smallest tile
            timed, timed_again = (max(sizes, key=lambda m: (u[-m], -m)) for u in (t, again))
            rows.append(dict(network=net, layer=names[0], spec=str(spec), predicted=predicted, timed=timed,
                             agree=predicted == timed, predicted_now=predicted_now,
                             agree_now=predicted_now == timed, read_gbs_now=bw_now / 1e9,
                             **{f"f{m}_ms": t[m] * 1e3 for m in sizes},
                             **{f"model_f{m}_ms": s * 1e3 for m, s in model_s.items()},
                             **{f"f2_over_f{m}": t[-m] for m in sizes if m != min(sizes)},
                             timed_again=timed_again,
                             **{f"f2_over_f{m}_again": again[-m] for m in sizes if m != min(sizes)},
                             peak_gflops=peak / 1e9, read_gbs=bw / 1e9,
                             **{f"ceiling_f{m}": shares.get((m, spec.kh), 1.0) for m in sizes}))
            r = rows[-1]
            print(f"{net:12s} {names[0]:28s} {str(spec):34s} predicted F({predicted}) "
                  f"(at {bw_now / 1e9:.0f} GB/s now: F({predicted_now})) timed F({timed}), "
                  f"then F({timed_again}){'' if r['agree'] else '  DIFFER'}  "
                  + ", ".join(f"F({m}) {t[m] * 1e3:.3f} ms" for m in sizes), flush=True)
            write_csv(out / "winograd_tiles.csv", rows)
    write_env(out / "winograd_tiles.csv", peak_gflops=peak / 1e9, read_gbs=bw / 1e9,
              **{f"ceiling_f{m}x{r}": e for (m, r), e in shares.items()})
    print(summarise([{k: str(v) for k, v in r.items()} for r in rows]))
    return 0


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: how often the predicted tile size is the timed one."""
    agree = sum(r["agree"] == "True" for r in rows)
    clear = [r for r in rows if abs(num(r, "f2_over_f4") - 1) > TIE]
    differ = [f"{r['spec']} (F({r['predicted']}) predicted, F({r['timed']}) timed, "
              f"F(2)/F(4) {num(r, 'f2_over_f4'):.2f})" for r in rows if r["agree"] != "True"]
    again = [r for r in rows if r.get("timed_again")]
    stable = [r for r in again if r["timed"] == r["timed_again"]]
    repeat = (f"; timing itself picked the same tile again on {len(stable)} of {len(again)}, and there the model "
              f"matched it on {sum(r['agree'] == 'True' for r in stable)} of {len(stable)}" if again else "")
    now = [r for r in rows if r.get("agree_now")]
    agree_now = (f" (with the DRAM reads timed beside each conv: {sum(r['agree_now'] == 'True' for r in now)} of "
                 f"{len(now)})" if now else "")
    return (f"tile model = timed choice on {agree} of {len(rows)} convs ({100 * agree / max(len(rows), 1):.0f}%)"
            f"{agree_now}; "
            f"where the two tile sizes differ by more than {100 * TIE:.0f}%: {sum(r['agree'] == 'True' for r in clear)} "
            f"of {len(clear)}{repeat}" + (f"; differ: {'; '.join(differ)}" if differ else ""))


if __name__ == "__main__":
    sys.exit(main())
