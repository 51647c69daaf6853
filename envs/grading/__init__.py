"""Grading model predictions on SWE rows as the swebench harness does (`envs.evaluate`, the
command line): reading predictions (`predictions`) and applying their patches (`patch`)."""
