"""Symbolic I/O lower bounds of convolution, optimal tiles and an I/O simulator.

    derive_conv()                         the paper's derivation in sympy (T, Q_lower, Q_dataflow, conditions)
    conv_io_lower_bound(spec, S)          eq. (7), loads + stores in elements
    best_lower_bound(spec, S)             the largest valid bound (eq. 7, compulsory, GEMM for 1x1)
    max_reuse(spec)                       R, the exact maximal reuse of one input element
    optimal_tile(spec, S, Np=1)           the I/O-optimal integer tile of the alpha=1 dataflow
    dataflow_io(spec, tile)               that dataflow's exact loads + stores
    tiles_for_target(spec, target)        the tile at every memory level
    simulate_io(spec, tile, S, policy)    replay the loop nest through an LRU or OPT cache
    network_floor(layers, S, image, ...)  a whole network's floor at batch 1: weights, live sets, flops
                                          of the cheapest algorithm, and the floor in time (network.py)
    winograd_cost(spec, m), predict_tile(spec, P, B, e)  Winograd's multiplies, U/V/M traffic and footprint,
                                          and the tile size of least modelled time at the tile
                                          sizes' measured shares e of the peak (winograd.py)
    network_reach(layers, P, B, e)        what MACO's kernel families reach at those shares, one layer
                                          at a time: a model to set beside the floor, not a bound
"""
from maco.bounds.conv import (BoundReport, ConvDerivation, best_lower_bound, bound_report,
                              compulsory_io, conv_as_gemm, conv_io_lower_bound, derive_conv,
                              gemm_io_leading, gemm_io_lower_bound, max_reuse, pebble_T, vertex_count)
from maco.bounds.network import NetLayer, NetworkFloor, derive_network, network_floor
from maco.bounds.winograd import WinogradCost, network_reach, predict_tile, winograd_cost
from maco.bounds.pebble import PebbleBound, Stage, multistage_bound
from maco.bounds.simulate import IOCounts, schedule_loops, simulate_io, tile_loops
from maco.bounds.tiles import Tile, continuous_tile, dataflow_io, dataflow_loads, optimal_tile, tiles_for_target

__all__ = ["BoundReport", "ConvDerivation", "IOCounts", "PebbleBound", "Stage", "Tile", "best_lower_bound",
           "bound_report", "compulsory_io", "continuous_tile", "conv_as_gemm", "conv_io_lower_bound",
           "dataflow_io", "dataflow_loads", "derive_conv", "gemm_io_leading",
           "gemm_io_lower_bound", "max_reuse", "multistage_bound", "NetLayer", "NetworkFloor",
           "derive_network", "network_floor", "network_reach", "WinogradCost", "predict_tile", "winograd_cost", "optimal_tile", "pebble_T",
           "schedule_loops", "simulate_io", "tile_loops", "tiles_for_target", "vertex_count"]
