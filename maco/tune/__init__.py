"""Tuning: records, the cost model and its prior, the search, measurement (local worker, GPU,
Ray cluster) and `tune_layers`, which runs them."""
