"""Symbolic I/O lower bounds of convolution, optimal tiles and an I/O simulator."""
