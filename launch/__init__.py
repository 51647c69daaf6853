"""Arbor launchers: configs to jobs (docs/design.md §1; imports only configs, never models/...).

    python -m launch.tpu    # trainer.main on a Cloud TPU slice (queued resource, spot/requeue)
    python -m launch.xm     # parameter sweeps: XManager local executor, subprocesses or TPU slices
    python -m launch.fleet  # CPU-VM sandbox fleet (instance template + MIG), or --local

Every launcher takes --dry_run (prints the gcloud commands and boot scripts, runs nothing).
Sizing for the slices and the fleet: docs/scaling.md (benchmarks/sizing.py).
"""
