"""`python -m envs.synth`: the command line of `envs.synth` (its docstring)."""

from envs.synth.core import main

raise SystemExit(main())
