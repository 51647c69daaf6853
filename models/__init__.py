"""Arbor models: one Transformer for dense GQA and MoE + MLA decoders, kernels, sharding, HF I/O."""

from models.config import ModelConfig
