"""The math of learning from trajectories: trees and packing, advantages, losses, group filters,
train/inference mismatch corrections, test-time selection (JAX and NumPy; no models, no envs)."""
