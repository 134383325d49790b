"""What `maco optimize` leaves in its output folder: the per-layer table (CSV), its plot (PNG),
the end-to-end numbers (JSON) and report.md, each written whole or not at all; a file that cannot
be written (a full disk) is one line naming the folder. One run at a time writes to a folder: it
holds a lock there (hold_output_folder)."""
from __future__ import annotations

import contextvars
import csv
import fcntl
import functools
import io
import json
import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch import nn

from maco.core.errors import MacoError
from maco.core.files import write_atomic
from maco.deploy.kernel_choice import MIN_GAIN
from maco.layouts import LayoutPlan
from maco.layouts.end_to_end import ConvShare, ModelTimes
from maco.layouts.network_floor import ModelFloor
from maco.layouts.maco_modules import MacoConv2d
from maco.core.spec import ConvSpec
from maco.core.target import Target
from maco.core.timing import environment


@dataclass
class LayerRow:
    name: str
    spec: ConvSpec
    count: int
    trials: int
    maco: dict[str, float] = field(default_factory=dict)  # layout -> best seconds
    torch: dict[str, float] = field(default_factory=dict)
    planned: str = ""
    uses_maco: bool = False
    in_process: dict[str, float] = field(default_factory=dict)  # layout -> torch time / MACO time


@dataclass
class OptimizeResult:
    """What the job found and the model it hands back: the fastest of the variants it timed."""

    model_name: str
    out: Path
    rows: list[LayerRow]
    plan: LayoutPlan
    end_to_end: dict[str, Any]  # variant -> its time, speedup over the default, output difference
    seconds: float
    model: nn.Module | None = None  # the variant handed back
    chosen: str = "default"
    example: Any = None  # the input it was planned and timed on
    share: ConvShare | None = None  # the chosen model's time beside its conv kernels'
    target: Target | None = None
    engines: list[dict[str, Any]] = field(default_factory=list)  # maco.deploy.engines rows, MACO's last
    floor: ModelFloor | None = None  # the network floor and each kernel's, on this host (CPU)


LOCK_NAME = ".maco-optimize.lock"  # in the output folder: held (flock) by the run writing there
_HELD: contextvars.ContextVar[ExitStack | None] = contextvars.ContextVar("maco_output_locks", default=None)


def one_run_per_output_folder(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of `optimize`: an output folder it locks (hold_output_folder) stays locked until
    the call returns or fails, and is released then."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with ExitStack() as stack:
            token = _HELD.set(stack)
            try:
                return fn(*args, **kwargs)
            finally:
                _HELD.reset(token)
    return call


def hold_output_folder(out: Path) -> None:
    """Lock `out` for this run (a non-blocking flock on LOCK_NAME inside it), so that two runs
    never mix their plan, model and report in one folder; MacoError naming the folder when
    another run holds it. Released when the call decorated by one_run_per_output_folder ends."""
    stack = _HELD.get()
    if stack is None:
        raise RuntimeError("hold_output_folder needs a call decorated with one_run_per_output_folder")
    lock = out / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise MacoError(f"cannot lock the output folder {str(out)!r} ({lock.name}: {exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise MacoError(f"the output folder {str(out)!r} is in use: another maco optimize run holds its lock "
                        f"{lock.name}; wait for it to finish or give another --out") from None
    stack.callback(os.close, fd)


def end_to_end_rows(times: ModelTimes, pick: str) -> dict[str, dict[str, Any]]:
    """Per variant (all but the reference "default"): the medians of the per-round times of the
    default and of the variant, the median of the per-round ratios (the speedup), and the ratio of
    those two medians. The two ratios are different statistics of the same rounds; on a drifting
    machine they may even disagree in direction, so the report prints both and says which is which."""
    default_s = times.timing("default").median
    out = {}
    for label in times.rounds:
        if label == "default":
            continue
        planned_s = times.timing(label).median
        out[label] = {"default_s": default_s, "planned_s": planned_s, "speedup": times.speedup(label),
                      "ratio_of_medians": default_s / planned_s, "max_abs_diff": times.max_abs_diff[label],
                      "chosen": label == pick}
    return out


def write_outputs(result: OptimizeResult, target: Target, records: Path, swapped: list[str]) -> None:
    out = result.out
    gf = lambda spec, s: spec.flops / s / 1e9 if s else None  # noqa: E731
    header = ["layer", "spec", "layers", "trials", "maco_nchw_gflops", "maco_nhwc_gflops",
              "torch_nchw_gflops", "torch_nhwc_gflops", "in_process_nchw", "in_process_nhwc",
              "planned_layout", "uses_maco"]
    lines = []
    for r in result.rows:
        lines.append([r.name, str(r.spec), r.count, r.trials,
                      *(_fmt(gf(r.spec, d.get(lay))) for d in (r.maco, r.torch) for lay in ("NCHW", "NHWC")),
                      *(_fmt(r.in_process.get(lay)) for lay in ("NCHW", "NHWC")), r.planned,
                      int(r.uses_maco)])
    text = io.StringIO()
    w = csv.writer(text)
    w.writerow(header)
    w.writerows(lines)
    files = {"layers.csv": lambda: text.getvalue(), "layers.png": lambda: _plot(result),
             "end_to_end.json": lambda: json.dumps(result.end_to_end, indent=2)}
    if result.share is not None:
        split = result.share.to_dict() | ({"floor": result.floor.to_dict()} if result.floor else {})
        files["time_split.json"] = lambda: json.dumps(split, indent=2)
        files["time_split.png"] = lambda: _time_split_plot(result.model_name, result.share, result.floor)
    files["report.md"] = lambda: report_markdown(result, target, records, swapped)
    # each file whole or not at all, and one that cannot be written (a full disk) does not keep
    # the others from being written: then one line names the folder and what is missing
    failed: dict[str, OSError] = {}
    for name, data in files.items():
        try:
            write_atomic(out / name, data())
        except OSError as exc:
            failed[name] = exc
    if failed:
        raise output_error(out, failed)


def output_error(out: Path, failed: dict[str, OSError]) -> MacoError:
    """One line naming the output folder, the files not written and why."""
    reasons = sorted({exc.strerror or str(exc) for exc in failed.values()})
    return MacoError(f"cannot write {', '.join(failed)} to the output folder {str(out)!r} "
                     f"({'; '.join(reasons)}); every other file there was written whole")


def save_output(out: Path, name: str, data: str | bytes) -> None:
    """Write `name` into the output folder whole or not at all; a full disk (or any other
    failure to write) is one line naming the folder."""
    try:
        write_atomic(out / name, data)
    except OSError as exc:
        raise output_error(out, {name: exc}) from None


def _ratios(by_layout: dict[str, float]) -> str:
    return ", ".join(f"{lay} {v:.2f}x" for lay, v in sorted(by_layout.items())) or "-"


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def _plot(result: OptimizeResult) -> bytes:
    """The per-layer plot as PNG bytes."""
    plt = _pyplot()
    rows = result.rows
    idx = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    bars = [("MACO NCHW", lambda r: r.maco.get("NCHW")), ("MACO NHWC", lambda r: r.maco.get("NHWC")),
            ("torch NCHW", lambda r: r.torch.get("NCHW")), ("torch NHWC", lambda r: r.torch.get("NHWC"))]
    for i, (label, get) in enumerate(bars):
        vals = [r.spec.flops / get(r) / 1e9 if get(r) else 0 for r in rows]
        ax.bar(idx + (i - 1.5) * 0.2, vals, 0.2, label=label)
    ax.set_xticks(idx, [r.name.split(" ")[0] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"{result.model_name}: best kernel per layer and layout")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def _time_split_plot(model_name: str, s: ConvShare, floor: ModelFloor | None) -> bytes:
    """Each conv kernel in the model's order: its time alone, with its weights in memory, inside
    the model, and its own floor, as PNG bytes: where the model's time goes at a glance."""
    plt = _pyplot()
    names = list(s.per_conv)
    series = [("alone", s.per_conv), ("weights in memory", s.per_conv_cold), ("inside the model", s.per_conv_in_model)]
    series = [(label, d) for label, d in series if d]
    idx = np.arange(len(names))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.28 * len(names) + 1.5)))
    for i, (label, d) in enumerate(series):
        ax.barh(idx + (i - (len(series) - 1) / 2) * width, [d.get(n, 0) * 1e6 for n in names], width, label=label)
    if floor is not None and floor.per_conv:
        ax.scatter([floor.per_conv.get(n, np.nan) * 1e6 for n in names], idx, marker="|", s=200, color="black",
                   zorder=3, label="its floor")
    ax.set_yticks(idx, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds")
    title = f"{model_name}: {s.model_s * 1e3:.2f} ms"
    if floor is not None and floor.seconds:
        title += f", {s.model_s / floor.seconds:.2f}x its network floor ({floor.seconds * 1e3:.2f} ms)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.6 / fig.get_figheight()), ncol=4)
    fig.tight_layout()
    return _png(fig)


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes (its legend kept when it sits outside the axes); closes it."""
    import matplotlib.pyplot as plt

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return png.getvalue()


def report_markdown(result: OptimizeResult, target: Target, records: Path, swapped: list[str]) -> str:
    """report.md: the machine, the per-layer table, the plan, the variants end to end, where the
    time goes and the other engines, one section each."""
    lines = (_header_and_layers(result, target) + _plan_section(result.plan, result.model)
             + _end_to_end_section(result, swapped) + _time_split_section(result) + _engines_section(result))
    lines += ["", "Files: `plan.json` (the plan of the fused graph: "
              "`maco.layouts.LayoutPlan.load(...).apply(maco.layouts.fuse(model, example_input))`), "
              f"`layers.csv`, `layers.png`, `end_to_end.json`, `time_split.json`, `time_split.png`; records: `{records}`.", ""]
    return "\n".join(lines)


def _header_and_layers(result: OptimizeResult, target: Target) -> list[str]:
    env = environment()
    lines = [f"# MACO optimize: {result.model_name} on {target.name}", "",
             f"Machine: {env.get('cpu')} ({env.get('isa')}, {env.get('cores')} cores), torch "
             f"{env.get('torch')}" + (f"; batch {result.example.shape[0]}" if result.example is not None else "")
             + (f", {target.cores} threads" if target.kind == "cpu" else "")
             + f". Took {result.seconds:.0f} s.", "",
             "## Per conv layer (GFLOP/s, best measured)", "",
             "| layer | spec | trials | MACO NCHW | MACO NHWC | torch NCHW | torch NHWC | in process | planned | runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gf = lambda spec, s: f"{spec.flops / s / 1e9:.1f}" if s else "-"  # noqa: E731
    for r in result.rows:
        lines.append(f"| {r.name} | `{r.spec}` | {r.trials} | {gf(r.spec, r.maco.get('NCHW'))} | "
                     f"{gf(r.spec, r.maco.get('NHWC'))} | {gf(r.spec, r.torch.get('NCHW'))} | "
                     f"{gf(r.spec, r.torch.get('NHWC'))} | {_ratios(r.in_process)} | {r.planned} | "
                     f"{'MACO' if r.uses_maco else 'torch'} |")
    return lines + ["", f"GFLOP/s are the tuner's (worker process, preallocated output). *in process*: torch's "
                    f"time over MACO's, re-timed here as the model runs the kernel (interleaved rounds); a "
                    f"kernel replaces torch's conv only above {MIN_GAIN:.2f}x."]


def _plan_section(plan: Any, model: nn.Module | None) -> list[str]:
    # convs that read their input in the layout before a conversion (maco_modules.fold_input_conversion)
    folded = sum(1 for m in (model.modules() if model is not None else ())
                 if isinstance(m, MacoConv2d) and m.input_layout != m.layout)
    return ["", "## Layout plan", "",
            f"{sum(1 for c in plan.convs if c.layout == 'NHWC')} of {len(plan.convs)} convs in NHWC, "
            f"{len(plan.conversions)} conversions"
            + (f" ({folded} of them read through by the conv after them, which needs no copy)" if folded else "")
            + f"; planner ({plan.method}) predicts "
            f"{plan.cost * 1e3:.2f} ms" + (f" vs {plan.default_cost * 1e3:.2f} ms all-NCHW"
                                           if plan.default_cost else "") + "."]


def _end_to_end_section(result: OptimizeResult, swapped: list[str]) -> list[str]:
    lines = ["", "## End to end (measured: every variant in the same interleaved rounds)", "",
             "Times: the median over rounds of each model's time in a round. Speedup (in bold): the "
             "median over rounds of the default's time over the variant's in the same round; in "
             "brackets the ratio of the two printed medians, a different statistic of the same rounds "
             "(on a drifting machine the two can differ). The model handed back is the variant with "
             "the highest speedup whose output equals the default's.", ""]
    default_s = next(iter(result.end_to_end.values()), {}).get("default_s")
    if default_s:
        lines.append(f"- default (the model as given, torch eager): {default_s * 1e3:.2f} ms")
    for key, e in result.end_to_end.items():
        label = VARIANTS.get(key, key).format(swapped=len(swapped))
        lines.append(f"- {label}: {e['planned_s'] * 1e3:.2f} ms, **{e['speedup']:.2f}x** per round "
                     f"({e['default_s'] / e['planned_s']:.2f}x from the medians; max |diff| "
                     f"{e['max_abs_diff']:.2g})" + (" <- handed back" if e.get("chosen") else ""))
    if "planned_maco" not in result.end_to_end:
        lines.append("- no MACO kernel beat torch in its planned layout: no variant runs MACO kernels")
    return lines + ["", f"Handed back: **{result.chosen}**" + (
        " (no variant was faster than the model as given)" if result.chosen == "default" else
        f", {result.end_to_end[result.chosen]['speedup']:.2f}x the default per round in the same "
        "rounds") + "."]


def _time_split_section(result: OptimizeResult) -> list[str]:
    if result.share is None:
        return []
    s = result.share
    lines = ["", "## Where the time goes (the handed-back model, its convs timed alone in the same rounds)", "",
             f"Model {s.model_s * 1e3:.2f} ms; its {len(s.per_conv)} conv kernels alone add up to "
             f"{s.convs_s * 1e3:.2f} ms, so **{100 * s.outside:.0f}%**{outside_note(s)} of the model's time "
             f"is spent outside them (model / kernels = {s.ratio:.2f}). With its MACO kernels skipped the model "
             f"takes {s.rest_s * 1e3:.2f} ms (pooling, the classifier, unfused ops, conversions, "
             "Python); the rest of the difference is the kernels running slower in the model than "
             "alone (weights and activations no longer in cache)."]
    if s.per_conv_cold:
        lines += ["", f"Timed with its weights dropped from the caches before each call (its "
                  f"weights in memory, as inside a model whose weights outgrow the caches), the kernels "
                  f"add up to {s.convs_cold_s * 1e3:.2f} ms: model / kernels = "
                  f"{s.model_s / s.convs_cold_s:.2f}."]
    lines += _in_model_lines(s) + _floor_lines(s, result.floor)
    return lines + ["", "The model's time here and in *End to end* can differ for the same model: here it "
                    "runs round after round beside its own kernels, so its weights are often still in "
                    "cache; there each round alternates it with the other variants, whose runs evict them."]


def _in_model_lines(s: ConvShare) -> list[str]:
    """The kernels timed inside the model's C calls beside the same kernels alone, and the convs
    that lose most there."""
    if not s.per_conv_in_model:
        return []
    n, alone = len(s.per_conv_in_model), s.alone_s
    lines = ["", f"Timed inside the model's C calls (model calls back to back), {n} of its conv kernels take "
             f"{s.convs_in_model_s * 1e3:.2f} ms against {alone * 1e3:.2f} ms alone: **in the model / alone = "
             f"{s.convs_in_model_s / alone:.2f}**. Where they lose most:", "",
             "| conv | alone us | in the model us | cold us | in the model / alone |", "|---|---|---|---|---|"]
    loss = sorted(s.per_conv_in_model, key=lambda c: s.per_conv[c] - s.per_conv_in_model[c])[:5]
    for name in loss:
        cold = s.per_conv_cold.get(name)
        lines.append(f"| {name} | {s.per_conv[name] * 1e6:.0f} | {s.per_conv_in_model[name] * 1e6:.0f} | "
                     f"{'' if cold is None else f'{cold * 1e6:.0f}'} | "
                     f"{s.per_conv_in_model[name] / s.per_conv[name]:.2f} |")
    return lines


def _floor_lines(s: ConvShare, floor: ModelFloor | None) -> list[str]:
    """The model beside its network floor, and the kernels furthest above their own floors."""
    if floor is None or not floor.seconds:
        return []
    net = floor.network
    lines = ["", f"**Against the floor** (maco.bounds.network, `maco bound NET --network`; this host's best FMA "
             f"peak {(net.peak or 0) / 1e9:.0f} GFLOP/s and DRAM read {(net.bandwidth or 0) / 1e9:.1f} GB/s, "
             f"memory overlapping compute): the network floor is {_time(floor.seconds)}, bound by "
             f"{net.binds}; the model's {_time(s.model_s)} is **{s.model_s / floor.seconds:.2f}x** it"
             f"{floor.busy_note()}."]
    if floor.reach:
        lines[-1] += (f" MACO's kernel families at their ceilings (direct convs at the peak, Winograd and depthwise "
                      f"at the shares of it timed here, each layer's filters, weights or U, from DRAM) would take "
                      f"{_time(floor.reach)}, {floor.reach / floor.seconds:.2f}x the floor: the distance above that is "
                      "the kernels' and the model's, not the floor's (bounds.winograd.network_reach).")
    timed = {name: s.per_conv_in_model.get(name, s.per_conv.get(name)) for name in floor.per_conv}
    timed = {name: t for name, t in timed.items() if t}
    if not timed:
        return lines
    total, mine = sum(floor.per_conv[n] for n in timed), sum(timed.values())
    lines += [f"Each kernel's own floor is its convs' cheapest multiplies at that peak or its weights from DRAM, "
              f"whichever takes longer: {len(timed)} kernels take {_time(mine)} (inside the model where "
              f"timed there) against {_time(total)} of floors ({mine / total:.2f}x). Furthest above theirs:",
              "", "| conv | cheapest algorithm | floor us | time us | time / floor |", "|---|---|---|---|---|"]
    for name in sorted(timed, key=lambda n: floor.per_conv[n] - timed[n])[:5]:
        lines.append(f"| {name} | {floor.algorithms[name]} | {floor.per_conv[name] * 1e6:.0f} | "
                     f"{timed[name] * 1e6:.0f} | {timed[name] / floor.per_conv[name]:.2f} |")
    return lines


def _time(seconds: float) -> str:
    """Milliseconds to two decimals, or microseconds below a tenth of one."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.1f} us"


def _engines_section(result: OptimizeResult) -> list[str]:
    if not result.engines:
        return []
    lines = ["", "## Beside other engines", "",
             "Each engine in its own process, alternating round by round with torch eager NCHW there "
             "(maco.deploy.engines): speedup = the median of the per-round ratios eager / engine; the times are "
             "the medians of the rounds. *maco* is the model handed back, loaded from its saved file.", "",
             "| engine | eager ms | engine ms | speedup over eager | build s | max rel. error | note |",
             "|---|---|---|---|---|---|---|"]
    for e in result.engines:
        lines.append(f"| {e['engine']} | {_num(e.get('eager_ms'))} | {_num(e.get('engine_ms'))} | "
                     f"{_num(e.get('speedup'))}x | {_num(e.get('compile_s'), '.1f')} | "
                     f"{_num(e.get('max_rel_err'), '.1e')} | {e.get('note', '')} |")
    return lines + ["", engine_summary(result.engines)]


def outside_note(share: ConvShare) -> str:
    """What to print beside the share of a model's time outside its conv kernels: "" where it can
    stand bare; where it is negative (the kernels alone added up to more than the whole model, which
    runs them all and more), that it is impossible and why it came about. The model and its kernels
    are timed in the same rounds with no reference beside them, so a busy spell that hit some
    rounds' kernels and not the model shows only here."""
    if share.outside >= 0:
        return ""
    return (f" (impossible: the kernels alone took {share.convs_s / share.model_s:.2f}x the whole model, which "
            "runs them all; the machine was busy or the timing noisy; figure unreliable)")


def engine_summary(rows: list[dict[str, Any]]) -> str:
    """Where MACO's row ranks among the engines timed, by speedup over eager."""
    timed = sorted((r for r in rows if isinstance(r.get("speedup"), (int, float))), key=lambda r: -r["speedup"])
    rank = next((i for i, r in enumerate(timed, 1) if r["engine"] == "maco"), None)
    if rank is None:
        return "MACO's model could not be timed beside the engines (see its note)."
    best_other = next((r for r in timed if r["engine"] != "maco"), None)
    return (f"MACO is {rank} of {len(timed)} by the speedup over eager" + (
        f"; {timed[rank - 1]['speedup'] / best_other['speedup']:.2f}x the fastest other engine "
        f"({best_other['engine']})" if best_other else "") + ".")


def _num(value: Any, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


VARIANTS = {"fused": "BatchNorm folded, epilogues fused, torch convs (NCHW)",
            "planned_torch": "fused, planned layouts, torch convs",
            "planned_maco": "fused, planned layouts, MACO kernels in {swapped} convs"}
