"""Arbor launchers, configs to jobs: TPU slices (`launch.tpu`), sweeps (`launch.xm`) and the
CPU-VM sandbox fleet (`launch.fleet`); imports configs and JAX-free envs, never models/rl/trainer.
"""
