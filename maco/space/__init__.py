"""The schedule space of a conv (CPU and GPU sketches in `schedules`, the compute-in-memory
sketch in `cim`) and its pruning by the I/O bound's conditions (`prune`, `prune_cim`)."""
from maco.space.schedules import (contains, count_with, prune_plan, sample, sample_many, space_size,
                                  why_not)

__all__ = ["contains", "count_with", "prune_plan", "sample", "sample_many", "space_size", "why_not"]
