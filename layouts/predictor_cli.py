"""`python -m maco.layouts.predictor_cli DATA.csv OUT_DIR`: train a layout latency predictor on a
`maco collect` data set and save it where `maco plan --predictor` and $MACO_PREDICTOR read it."""
from __future__ import annotations

import argparse
from typing import Sequence

from maco.core.errors import MacoError
from maco.layouts.dataset import cpus_of, load_rows
from maco.layouts.latency import ConversionModel
from maco.layouts.predictor import LABELS
from maco.layouts.predictor_training import train_predictor


def main(argv: Sequence[str] | None = None) -> int:
    """python -m maco.layouts.predictor_cli DATA.csv OUT_DIR: NAS, retrain, calibrate conversions, save."""
    p = argparse.ArgumentParser(prog="python -m maco.layouts.predictor_cli",
                                description="Train a layout latency predictor on a `maco collect` data set.")
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--timeout", type=float, default=None, help="NAS time limit in seconds")
    p.add_argument("--ensemble", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", choices=LABELS, default=None,
                   help="what to learn (default: ratio to the reference where every row has one, else seconds)")
    args = p.parse_args(argv)
    try:
        conv = ConversionModel.calibrate(args.device)
        rows = [r for r in load_rows(args.data) if r.device == args.device]
        pred = train_predictor(rows, trials=args.trials, epochs=args.epochs,
                               timeout=args.timeout, ensemble=args.ensemble, seed=args.seed,
                               device=args.device, conversion=conv, label=args.label)
        pred.meta["cpus"] = cpus_of(args.data, rows)
        pred.save(args.out)
    except MacoError as exc:
        print(f"error: {exc}")
        return 2
    print(f"saved {args.out}: {pred.config} {pred.meta}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
