"""Layouts: networks, latency data and predictor, transform costs, planners, deployment."""

# Layout planning and deployment, by name -> module (lazy, so `import maco.layouts.networks`
# does not load the planners, the predictor or the records).
_PLANNING = {"LayoutProblem": "problem", "Solution": "problem", "PlannerTimeout": "problem",
             "solve": "planners", "trace": "graph", "LayerGraph": "graph",
             "build_problem": "model_problem",
             "Costs": "latency_sources", "latency_source": "latency_sources",
             "load_predictor": "latency_sources",
             "LayoutPlan": "layout_plan", "LayerPlan": "layout_plan",
             "plan": "deploy",
             "compare_end_to_end": "end_to_end", "EndToEnd": "end_to_end",
             "time_models": "end_to_end", "ModelTimes": "end_to_end", "conv_share": "end_to_end",
             "ConvShare": "end_to_end", "fuse": "fusion", "FusedConv2d": "fusion",
             "MacoConv2d": "maco_modules", "use_maco_kernels": "maco_modules"}


def __getattr__(name: str):
    if name in _PLANNING:
        import importlib

        return getattr(importlib.import_module(f"maco.layouts.{_PLANNING[name]}"), name)
    raise AttributeError(f"module 'maco.layouts' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PLANNING])
