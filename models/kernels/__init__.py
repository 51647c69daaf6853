"""Attention kernels behind one function: `models.kernels.attention.attention`."""
