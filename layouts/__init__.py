"""Layouts: networks, latency data and predictor, transform costs, planners, deployment."""

# Layout planning and deployment (lazy, so `import maco.layouts.networks` stays light).
_PLANNING = {"LayoutProblem": "problem", "Solution": "problem", "PlannerTimeout": "problem",
             "solve": "planners", "plan": "deploy", "LayoutPlan": "deploy", "LayerPlan": "deploy",
             "trace": "graph", "LayerGraph": "graph"}


def __getattr__(name: str):
    if name in _PLANNING:
        import importlib

        return getattr(importlib.import_module(f"maco.layouts.{_PLANNING[name]}"), name)
    raise AttributeError(f"module 'maco.layouts' has no attribute {name!r}")
