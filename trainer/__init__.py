"""Composition: the entry point, the train state and step, and the SFT / RL / distillation /
eval loops that join models, rl and envs; checkpoints, data pipelines, metrics, policy server.

  main.py            `python -m trainer.main --config=... --workdir=...`: validate, then a mode
  config.py          validation and the typed configs read from a ConfigDict (configs/base.py)
  harness.py         what every training loop does around its steps (state, checkpoints, SIGTERM)
  state.py, step.py  the train state; the jitted train step and the scoring pass
  optim/             AdamW, Muon, MuonClip (QK-Clip) as optax transformations
  batches.py         trajectory trees -> fixed-shape micro-batches
  sft.py             the SFT loop; data.py / sft_data.py its grain pipeline and record formats
  rl.py              the RL / distillation loop; groups.py (filters, advantages, packing),
                     rollout_sources.py (in-process or queue), rollouts.py (episodes and the
                     engine from a config), tasks.py, teachers.py
  evaluate.py        held-out pass@k (mode "eval"); selection.py test-time selection
  serve.py           `python -m trainer.serve`: the policy server (token-in/token-out and
                     OpenAI-compatible); serving/ its parts (server, chat, completions,
                     request validation)
  demo.py            the demo pipeline; demo_data.py, tokenizer_train.py its generated inputs
  aot.py             `python -m trainer.aot`: a run's programs compiled for a TPU slice
                     (aot_engine.py the engine's)
  export.py          `python -m trainer.export`: a run's checkpoint -> Hugging Face dir
  checkpoint.py, metrics.py, report.py, distributed.py   the chores
"""
