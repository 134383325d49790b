"""The experiments behind the paper's figures, one script per figure (installed as maco.experiments).

Each module declares FIGURE (a common.Figure: the paper's number, why ours differs, how to run
it) and summarise(rows), its line in REPORT.md from the CSV it writes. `maco reproduce` finds
them through FIGURES below (figure name -> module, in the report's order), so adding a figure
touches this folder only. Run one as `python experiments/<module>.py` from a checkout or as
`python -m maco.experiments.<module>`.
"""

FIGURES: dict[str, str] = {
    "bounds": "bounds_table",
    "fig03": "fig03_layouts_per_layer",
    "fig06": "fig06_space_size",
    "kernels_cpu": "kernels_cpu",
    "ceiling": "register_ceiling",
    "winograd": "winograd_cpu",
    "winograd_tiles": "winograd_tiles",
    "fig12": "fig12_layout_plan",
    "fig13": "fig13_predictor_r2",
    "fig14": "fig14_error_threshold",
    "fig15": "fig15_kernels_gpu",
    "fig16": "fig16_search",
    "fig17": "fig17_cache",
    "network_gpu": "network_gpu",
    "fig18": "fig18_end_to_end",
    "engines": "engines_cpu",
    "threads": "threads_cpu",
    "deployment": "deployment_cpu",
    "pruning": "pruning_recall",
    "planners": "planner_runtime",
    "cluster": "cluster_builds",
    "cim": "cim_weight_updates",
    "repeat": "repeatability",
    "peers": "peers_cpu",
}
