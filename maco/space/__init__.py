"""The schedule space of a conv (`schedules` dispatches to the CPU sketch's tables in `cpu`, the
GPU sketch's in `gpu` and the compute-in-memory sketch in `cim`) and its pruning by the I/O
bound's conditions (`prune`, `prune_cim`)."""
from maco.space.schedules import (contains, count_with, prune_plan, sample, sample_many, space_size,
                                  why_not)

__all__ = ["contains", "count_with", "prune_plan", "sample", "sample_many", "space_size", "why_not"]
