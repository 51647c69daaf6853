"""Attention under the tree rule behind one function, `models.kernels.attention.attention`: the
XLA reference, a blocked XLA flash loop, and Pallas TPU and GPU kernels."""
