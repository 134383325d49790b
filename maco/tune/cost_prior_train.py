"""Training the cost model's prior, the booster that ranks a conv's schedules before the conv has
measurements of its own, on other convs' measured CPU schedules; and its command,
`python -m maco.tune.cost_prior_train RECORDS...`, which rebuilds the shipped one (PRIOR_FILE)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Iterable

from maco.core.errors import MacoError
from maco.core.files import write_atomic
from maco.core.spec import ConvSpec
from maco.core.target import CPU_ISAS, Target
from maco.core.xgb_check import CHECKSUM_ATTR, check_checksum, content_sha256
from maco.tune.cost_model import MIN_TRAINING_RECORDS, PRIOR_FILE, train_booster, training_rows
from maco.tune.records import Record, RecordFile


def train_prior(records: Iterable[Record], exclude: Iterable[ConvSpec] = (), seed: int = 0, rounds: int = 200):
    """A booster for convs with no records of their own, trained on other convs' measured CPU
    schedules, each on the machine it was measured on; `exclude` holds convs out (an experiment
    that scores a search on a conv must not rank it with that conv's own measurements)."""
    skip = set(exclude)
    groups: dict[tuple[ConvSpec, Target], list[Record]] = {}
    targets: dict[str, Target] = {}
    for r in records:
        if r.spec in skip or r.retryable or r.target.get("kind") != "cpu" or r.target.get("isa") not in CPU_ISAS:
            continue
        key = json.dumps(r.target, sort_keys=True)
        if key not in targets:  # one Target per machine, not per record
            targets[key] = Target.from_fingerprint(r.target)
        groups.setdefault((r.spec, targets[key]), []).append(r)
    rows, ys = training_rows(groups)
    if len(rows) < MIN_TRAINING_RECORDS:
        raise MacoError(f"a prior needs at least {MIN_TRAINING_RECORDS} measured CPU schedules, got {len(rows)}")
    booster = train_booster(rows, ys, seed, rounds)
    booster.set_attr(isas=",".join(sorted({t.isa for _, t in groups})), convs=str(len({s for s, _ in groups})),
                     schedules=str(len(rows)))
    return booster


def save_prior(booster, path: str | os.PathLike[str]) -> None:
    """Write `booster` as XGBoost JSON, atomically, with its content's sha256 as the learner
    attribute load_prior checks."""
    booster.set_attr(**{CHECKSUM_ATTR: None})
    booster.set_attr(**{CHECKSUM_ATTR: content_sha256(json.loads(bytes(booster.save_raw("json"))))})
    write_atomic(path, bytes(booster.save_raw("json")))
    check_checksum(json.loads(Path(path).read_bytes()), str(path))


def main(argv: list[str] | None = None) -> int:
    """Rebuild the shipped prior from measured records (results/pruning_data*.jsonl.gz)."""
    ap = argparse.ArgumentParser(prog="python -m maco.tune.cost_prior_train", description=main.__doc__)
    ap.add_argument("records", nargs="+", type=Path, help="record files (.jsonl or .jsonl.gz)")
    ap.add_argument("--out", type=Path, default=PRIOR_FILE)
    args = ap.parse_args(argv)
    records = [r for path in args.records for r in RecordFile(path).load()]
    booster = train_prior(records)
    save_prior(booster, args.out)
    print(f"{args.out}: trained on {booster.attr('schedules')} schedules of {booster.attr('convs')} convs "
          f"({booster.attr('isas')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
