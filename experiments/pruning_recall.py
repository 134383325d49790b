"""Issue 19 part 1: what MACO's pruning conditions keep of the schedules that are measured fastest
(not a figure of the paper, which reports only the pruned search's results).

For every distinct conv of the networks, in both layouts, it measures a uniform sample of the
full schedule space (maco.space.schedules.sample_many, seeded: a rerun draws the same schedules), the
bound-derived default (maco.kernels.default_schedule) and the best records that searches found
(--records). Measurements are the tuner's (maco.tune.measure.Measurer: a worker process, outputs
checked against torch) in --rounds interleaved rounds: each round times every schedule of the
layer once, in a fresh shuffled order, so a slow spell of the VM hits all of them alike; a
schedule's time is the median of its rounds. Every measurement is appended to --data (a records
file), so a rerun only measures what is missing.

Then for each rule of the pruning plan in force (maco.space.schedules.prune_plan: the registers' rules,
each cache level's balance rule on its tile, every core busy, alpha = 1) alone, for all of them together ("MACO
pruning"), for the bounds' own conditions without alpha = 1 ("MACO pruning without alpha = 1": the
level rules judge a split window as a shallower pass, no loop order asked; PruneConfig.alpha_cpu),
for the balance conditions on the whole nest (maco.space.prune.balance_reasons: "nest
balance", no cache level is the bottleneck of the nest's replayed traffic, maco.bounds.hierarchy)
and for the register, busy-core and alpha rules with those in place of the per-level rules
("registers + alpha + nest balance"), it reports:
  removed     how many of the measured top 5% (by time; at least 3) the rule drops
  recall      the share of that top 5% the rule keeps
  near_recall the share it keeps of the schedules within 20% of the best measured (the top 5% of
              a uniform sample holds mediocre schedules on layers where few draws are good)
  reduction   full space size / space size under the rule (exact counts; for the nest balance rules
              estimated from --draws uniform draws of the full space)
and whether the default is in the pruned space and how far it is from the best measured. Every
balance is the target's nominal one over the pruning's tolerance (maco.bounds.hierarchy.
nominal_balance), never a measured one, so an analysis repeats; --analyse-only takes the target
from the records in --data (the machine they were measured on), not this host.

    python experiments/pruning_recall.py --quick             # 2 layers, 60 samples per layout
    python experiments/pruning_recall.py [--networks resnet18,alexnet,vgg11] [--samples 150]
                                         [--rounds 2] [--records results/records_cpu.jsonl]
                                         [--layers alexnet.features.3,...]

Measured data (one host per file; `gunzip -k` a copy to extend it rather than measure again, or
analyse it: `--analyse-only --networks NETS --data COPY`):
  results/pruning_data.jsonl.gz       ResNet-18, 100 samples per layout, 2 rounds, AMD EPYC (AVX-512)
  results/pruning_data_xeon.jsonl.gz  AlexNet (100 samples) and VGG-11 (50 samples), 2 rounds, Intel
                                      Xeon (AVX-512), one layer per run of at most 8 minutes
                                      (--networks vgg11 --layers vgg11.features.8): VGG-11's
                                      features.3, .6, .8, .11 and .13 were cut short there, so part
                                      of their schedules have one round, features.8 NHWC has 8
                                      schedules and features.13 NHWC none yet (rerun to extend)
The committed CSV is the analysis of the Xeon file; results/pruning_recall_amd.csv that of the AMD one.

A ceiling on the two targets together: the top 5% of a uniform sample stands for the top 5% of the
space, so a pruned space that keeps a share r of it holds at least r/20 of the space, i.e. cuts it
at most 20/r-fold: recall 0.9 allows 22x at most (the default and the searches' best, always
measured, loosen that a little on small samples).

Writes <out>/pruning_recall.csv (one row per layer, layout and rule) and .png (recall against
reduction per rule: mean recall, geomean reduction over the layers).
"""
from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from maco.experiments.common import (RESULTS, Figure, geomean, num, out_dir, parser, print_table, pyplot, quiet,
                                     save_plot, write_csv, write_env)

FIGURE = Figure(
    "pruning", "(not in the paper: it reports the pruned search, not what the conditions remove)",
    "each pruning rule's recall of the measured top-5% schedules and its space reduction, on a uniform "
    "sample of the full space plus the defaults and the searches' best, measured in interleaved rounds",
    csv=("pruning_recall.csv", "pruning_recall_amd.csv"), records=True)

NETWORKS = "resnet18,alexnet,vgg11"
LAYOUTS = ("NCHW", "NHWC")
TOP = 0.05
NEAR = 1.2  # near_recall: the share kept of the schedules within 20% of the best measured time
COLUMNS = ["layer", "spec", "layout", "rule", "measured", "top", "removed", "recall", "near", "near_recall",
           "reduction",
           "default_kept", "default_vs_best", "plan"]
DEFAULT_DATA = RESULTS / "pruning_data.jsonl"


def _key(schedule: Any) -> str:
    return json.dumps(schedule.to_dict(), sort_keys=True)


def candidates(spec: Any, target: Any, samples: int, seed: int, best: dict) -> dict[str, list]:
    """Per layout: the default, the searches' best records, and `samples` uniform draws (deduplicated)."""
    from maco import kernels
    from maco.space import schedules as space

    drawn = space.sample_many(spec, target, 2 * samples, rng=random.Random(f"{seed}:{spec}"))
    out = {}
    for layout in LAYOUTS:
        picks = [kernels.default_schedule(spec, target, layout)]
        picks += [r.schedule for r in best.get((spec, layout), [])]
        picks += [s for s in drawn if s.layout == layout][:samples]
        out[layout] = list({_key(s): s for s in picks}.values())
    return out


def recorded(spec: Any, target: Any, done: dict[tuple, list]) -> dict[str, list]:
    """Per layout: the default, then every schedule `done` (measured(data)) holds for `spec`."""
    from maco import kernels

    out = {}
    for layout in LAYOUTS:
        picks = [kernels.default_schedule(spec, target, layout)]
        picks += [runs[0].schedule for (sp, _), runs in done.items() if sp == spec and runs
                  and runs[0].schedule.layout == layout]
        out[layout] = list({_key(s): s for s in picks}.values())
    return out


def measured(data: Any, target: Any) -> dict[tuple, list]:
    """(spec, schedule key) -> the records `data` holds for it on `target` (read once per run)."""
    done: dict[tuple, list] = defaultdict(list)
    for r in data.load():
        if r.target == target.fingerprint():
            done[(r.spec, _key(r.schedule))].append(r)
    return done


def measure(spec: Any, schedules: list, target: Any, rounds: int, data: Any, done: dict[tuple, list],
            measurer: Any, bar: Any, seed: int) -> dict[str, float | None]:
    """Median seconds over `rounds` interleaved rounds per schedule (None: it failed); what `done`
    (measured(data)) already holds counts, what is missing is measured, appended to `data` and to `done`."""
    from maco.tune.records import make_record

    done = {_key(s): done[(spec, _key(s))] for s in schedules}  # the lists themselves: appends reach the caller's
    rng = random.Random(f"{seed}:{spec}:rounds")
    for round_no in range(rounds):
        todo = [s for s in schedules
                if len(done[_key(s)]) <= round_no and all(r.ok for r in done[_key(s)])]
        rng.shuffle(todo)
        for i in range(0, len(todo), 8):
            batch = todo[i:i + 8]
            records = [make_record(spec, target, s, timing, error)
                       for s, (timing, error) in zip(batch, measurer(spec, batch, target))]
            data.append(records)
            for s, r in zip(batch, records):
                done[_key(s)].append(r)
            bar(len(batch))
    out = {}
    for s in schedules:
        runs = done[_key(s)]
        out[_key(s)] = (sorted(r.seconds for r in runs)[len(runs) // 2]
                        if runs and all(r.ok for r in runs) else None)
    return out


ALL = "MACO pruning"
ALPHA_OFF = "alpha = 1 (not in force)"
NO_ALPHA = "MACO pruning without alpha = 1"
BUSY = "parallel loop (every core busy)"


def rule_plans(spec: Any, target: Any) -> dict[str, Any]:
    """The plan in force, and each of its rules alone (a PrunePlan holding only that rule; the
    registers' accumulator rule and their level's balance count as one)."""
    from maco.space.prune import PruneConfig
    from maco.space.schedules import prune_plan

    plan = prune_plan(spec, target)
    alone = replace(plan, registers=None, levels=(), alpha_one=False, cores=0)
    regs = tuple(r for r in plan.levels if r.level == "registers")
    out = {}
    if plan.registers is not None or regs:
        out["registers"] = replace(alone, registers=plan.registers, levels=regs)
    for rule in plan.levels:
        if rule.level != "registers":
            out[f"{rule.level} ({rule.tile} tile)"] = replace(alone, levels=(rule,))
    # alpha = 1 alone, also where the plan does not ask for it (CPU: the level rules judge window
    # splits instead), so that what it would cost stays in the table
    out["alpha = 1" if plan.alpha_one else ALPHA_OFF] = replace(alone, alpha_one=True)
    if plan.cores:
        out[BUSY] = replace(alone, cores=plan.cores)
    out[ALL] = plan
    if plan.alpha_one and target.kind == "cpu":  # the bounds' own conditions: no alpha = 1, the
        out[NO_ALPHA] = prune_plan(spec, target, PruneConfig(alpha_cpu=False))  # levels judge splits
    return out


def analysis_balance(target: Any) -> dict[str, float]:
    """The cache levels' balance the nest balance rules ask for: nominal over the tolerance."""
    from maco.bounds.hierarchy import nominal_balance
    from maco.space.prune import PruneConfig

    return {name: b / PruneConfig().tolerance for name, b in nominal_balance(target).items() if name != "registers"}


def data_target(data: Any) -> Any:
    """The CPU target the records in `data` were measured on (the most frequent fingerprint)."""
    from collections import Counter

    from maco.core.errors import MacoError
    from maco.core.target import MemoryLevel, Target

    seen = Counter(json.dumps(r.target, sort_keys=True) for r in data.load() if r.target.get("kind") == "cpu")
    if not seen:
        raise MacoError(f"{data.path} holds no CPU records to analyse")
    fp = json.loads(seen.most_common(1)[0][0])
    width = {"avx512": 16, "avx2": 8}.get(fp["isa"], 4)
    return Target(name=fp["name"], kind="cpu", cores=fp["cores"], simd_width=width, isa=fp["isa"],
                  model=fp["model"], levels=tuple(MemoryLevel(n, c, p, width) for n, c, p in fp["levels"]))


def analyse(layer: str, spec: Any, layout: str, schedules: list, seconds: dict, target: Any,
            balance: dict[str, float], draws: list) -> list[dict]:
    """One row per rule (module docstring). The balance rules (maco.bounds.hierarchy: every cache
    level crossed with at least the machine's balance of MACs per element) are not counted
    exactly: their reduction is estimated from `draws`, uniform draws of the full space."""
    from maco.space import prune, schedules as space

    timed = sorted((seconds[_key(s)], i) for i, s in enumerate(schedules) if seconds[_key(s)] is not None)
    if not timed:
        return []
    top = [schedules[i] for _, i in timed[:max(3, math.ceil(TOP * len(timed)))]]
    near = [schedules[i] for t, i in timed if t <= NEAR * timed[0][0]]
    default = schedules[0]
    full = space.count_with(spec, target)
    plans = rule_plans(spec, target)
    alpha_registers = replace(plans[ALL], levels=tuple(r for r in plans[ALL].levels if r.level == "registers"))
    checks = {name: (lambda s, plan=plan: prune.reasons(s, spec, target, plan)) for name, plan in plans.items()}
    checks["nest balance"] = lambda s: prune.balance_reasons(s, spec, target, balance)
    checks["registers + alpha + nest balance" if plans[ALL].alpha_one else "registers + nest balance"] = \
        lambda s: prune.reasons(s, spec, target, alpha_registers) or prune.balance_reasons(s, spec, target, balance)
    rows = []
    d = seconds[_key(default)]
    for name, check in checks.items():
        removed = sum(bool(check(s)) for s in top)
        near_kept = sum(not check(s) for s in near) / len(near)
        if name in plans:
            reduction = full / max(1, space.count_with(spec, target, plans[name]))
        else:
            reduction = (len(draws) + 1) / (sum(not check(s) for s in draws) + 1)
        rows.append({"layer": layer, "spec": str(spec), "layout": layout, "rule": name, "measured": len(timed),
                     "top": len(top), "removed": removed, "recall": 1 - removed / len(top), "near": len(near),
                     "near_recall": near_kept, "reduction": reduction,
                     "default_kept": not check(default), "default_vs_best": timed[0][0] / d if d else float("nan"),
                     "plan": plans[ALL].describe() if name == ALL else ""})
    return rows


def summary_by_rule(rows: list[dict]) -> dict[str, tuple[float, float, int]]:
    """Per rule: (mean recall, geomean reduction, layer-layouts whose default it drops)."""
    by: dict[str, list] = defaultdict(list)
    for r in rows:
        by[r["rule"]].append(r)
    return {rule: (sum(num(r, "recall") for r in rs) / len(rs), geomean([num(r, "reduction") for r in rs]),
                   sum(str(r["default_kept"]) != "True" for r in rs),
                   sum(num(r, "near_recall") for r in rs) / len(rs)) for rule, rs in by.items()}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (rule, (recall, reduction, _, near)) in enumerate(summary_by_rule(rows).items()):
        ax.scatter(reduction, recall, s=60, color=f"C{i}", marker="*" if rule == ALL else "o", label=rule)
        ax.scatter(reduction, near, s=60, facecolors="none", edgecolors=f"C{i}", marker="*" if rule == ALL else "o")
        ax.plot([reduction, reduction], [recall, near], color=f"C{i}", lw=0.6, alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("space reduction (full / kept, geomean over layers and layouts)")
    ax.set_ylabel(f"filled: recall of the measured top {TOP:.0%}\nhollow: of those within 20% of the best (mean)")
    ax.set_ylim(-0.02, 1.05)
    ax.axhline(0.9, color="gray", lw=0.8, ls="--")
    ax.axvline(100, color="gray", lw=0.8, ls="--")
    ax.set_title("MACO pruning rules: what they keep of the fastest measured schedules", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)


def summarise(rows: list[dict[str, str]]) -> str:
    """REPORT.md: per rule, recall of the top 5% and reduction; the pruned space and the defaults."""
    parts = [f"{rule}: recall {recall:.0%} (within 20% of the best: {near:.0%}), {reduction:.3g}x smaller"
             for rule, (recall, reduction, _, near) in summary_by_rule(rows).items()]
    alls = [r for r in rows if r["rule"] == ALL]
    dropped = sum(str(r["default_kept"]) != "True" for r in alls)
    return (f"{len(alls)} layer-layouts: " + "; ".join(parts)
            + f"; the pruned space drops the default on {dropped} of {len(alls)}")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="ResNet-18's layer1 and layer3 convs, 60 samples per layout")
    ap.add_argument("--networks", default=NETWORKS, help=f"comma-separated (default {NETWORKS})")
    ap.add_argument("--layers", default="", help="comma-separated layer names (e.g. alexnet.features.3) to keep "
                    "of --networks' distinct convs (default: all; measuring one layer per run)")
    ap.add_argument("--samples", type=int, default=150, help="uniform draws per layer and layout (default 150)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per schedule (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=None,
                    help=f"measurements kept across runs (default {DEFAULT_DATA.name} in --out)")
    ap.add_argument("--records", type=Path, action="append", default=[],
                    help="records of searches: their 3 best per layer and layout are measured too")
    ap.add_argument("--draws", type=int, default=2000,
                    help="uniform draws per layer and layout that estimate the balance rules' reduction (default 2000)")
    ap.add_argument("--analyse-only", action="store_true",
                    help="no measuring: analyse every schedule --data holds, on the target its records name")
    args = ap.parse_args(argv)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from maco.space import schedules as space
    from maco.kernels import host_target
    from maco.layouts.networks import build, conv_layers, distinct_convs, example_input
    from maco.tune.measure import Measurer
    from maco.tune.records import RecordFile
    from maco.core.spec import ConvSpec

    out = out_dir(args)
    data = RecordFile(args.data or out / DEFAULT_DATA.name)
    target = data_target(data) if args.analyse_only else host_target()
    if args.quick:
        layers = [("resnet18.layer1.0.conv1", ConvSpec.parse("n1_c64_h56_w56_k64_r3_p1")),
                  ("resnet18.layer3.0.conv2", ConvSpec.parse("n1_c256_h14_w14_k256_r3_p1"))]
        args.samples = 60
    else:
        seen: dict = {}
        for net in (n.strip() for n in args.networks.split(",") if n.strip()):
            for spec, names in distinct_convs(conv_layers(build(net), example_input(1))):
                seen.setdefault(spec, f"{net}.{names[0]}")
        layers = [(name, spec) for spec, name in seen.items()]
        wanted = {w.strip() for w in args.layers.split(",") if w.strip()}
        if wanted - {name for name, _ in layers}:
            raise SystemExit(f"--layers: no distinct conv named {sorted(wanted - {n for n, _ in layers})} in "
                             f"{args.networks} (have {', '.join(n for n, _ in layers)})")
        layers = [(name, spec) for name, spec in layers if not wanted or name in wanted]
    best: dict = defaultdict(list)
    for path in args.records:
        for r in sorted((r for r in RecordFile(path).load() if r.ok and r.target == target.fingerprint()),
                        key=lambda r: r.seconds):
            if len(best[(r.spec, r.schedule.layout)]) < 3:
                best[(r.spec, r.schedule.layout)].append(r)
    balance = analysis_balance(target)
    print(f"{target.model}: nominal balance over the tolerance (MACs per element a level's boundary must carry): "
          + ", ".join(f"{k} {v:.3g}" for k, v in balance.items()))
    done = measured(data, target)
    if args.analyse_only:  # what was measured: the draws, the defaults and the searches' best then
        plan = {(name, spec): recorded(spec, target, done) for name, spec in layers}
    else:
        plan = {(name, spec): candidates(spec, target, args.samples, args.seed, best) for name, spec in layers}
    total = sum(len(v) for c in plan.values() for v in c.values()) * args.rounds
    rows: list[dict] = []
    path = out / "pruning_recall.csv"
    bar = Progress(TextColumn("[bold]measuring"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.description}"))
    with (nullcontext() if args.analyse_only else Measurer(target)) as measurer, bar as progress:
        job = progress.add_task("", total=total)
        for (name, spec), per_layout in plan.items():
            draws = space.sample_many(spec, target, 2 * args.draws, rng=random.Random(f"draws:{spec}"))
            for layout, schedules in per_layout.items():
                progress.update(job, description=f"{name} {layout}")
                if not args.analyse_only:
                    quiet()
                seconds = measure(spec, schedules, target, 0 if args.analyse_only else args.rounds, data, done,
                                  measurer, lambda n: progress.advance(job, n), args.seed)
                rows += analyse(name, spec, layout, schedules, seconds, target, balance,
                                [s for s in draws if s.layout == layout])
            if rows:
                write_csv(path, rows, COLUMNS, floats=".4g")  # each layer kept as soon as it is done
    if not rows:
        print("nothing measured yet")
        return 1
    if args.analyse_only:  # the environment above is the analysis'; the timings are the records'
        write_env(path, analysis_only=True, measured_on=target.model, top=TOP, balance=balance,
                  schedules=sum(len(v) for c in plan.values() for v in c.values()))
    else:
        write_env(path, samples=args.samples, rounds=args.rounds, seed=args.seed, top=TOP, balance=balance)
    plot(rows, out / "pruning_recall.png")
    print_table(f"per rule over {len(rows) // max(1, len(summary_by_rule(rows)))} layer-layouts",
                ["rule", "mean recall of top 5%", "of those within 20% of best", "geomean reduction",
                 "defaults dropped"],
                [[rule, f"{a:.0%}", f"{d:.0%}", f"{b:.3g}x", str(c)]
                 for rule, (a, b, c, d) in summary_by_rule(rows).items()])
    print(summarise([{k: str(v) for k, v in r.items()} for r in rows]))
    print(f"wrote {path} and {path.with_suffix('.png').name}; measurements in {data.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
