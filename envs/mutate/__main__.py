"""`python -m envs.mutate`: the command line of `envs.mutate` (its docstring)."""

from envs.mutate import main

raise SystemExit(main())
