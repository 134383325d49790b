"""Layouts: networks, latency data and predictor, transform costs, planners, deployment."""
