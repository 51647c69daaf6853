"""The base experiment config: every section and field with its default and a one-line comment.

    from configs import base
    def get_config(arg=None):                 # configs/NAME.py
      c = base.base_config()
      c.mode = "rl"; c.rl.group_size = 16     # change what the experiment needs
      return c

Config files start from `base_config()`, change what they need and add nothing at the top level
(`model.overrides` takes any ModelConfig field). The defaults are an SFT run of the tiny
MoE + MLA model at demo data sizes. This module imports only ml_collections, so a launcher can
read a config without JAX; `trainer.config.validate` checks the values (the choice lists live
with the code that owns them: rl.losses.LOSSES, rl.advantages.ADVANTAGES, ...).
"""

import ml_collections

placeholder = ml_collections.config_dict.placeholder

FAMILIES = {  # Hugging Face family -> (chat format, example checkpoint: a placeholder path)
    "qwen2.5-coder": ("qwen2.5", "/path/to/Qwen2.5-Coder-7B-Instruct"),
    "qwen3": ("template", "/path/to/Qwen3-8B"),  # its own template: thinking, history rules
    "deepseek-v3": ("deepseek_v3", "/path/to/Moonlight-16B-A3B-Instruct"),
}


def base_config() -> ml_collections.ConfigDict:
  """Every section with its defaults; see the module docstring."""
  c = ml_collections.ConfigDict()
  c.mode = "sft"  # "smoke" | "sft" | "rl" | "distill" | "eval" | "serve" | "demo" | "reward_model"
  c.seed = 0  # the run's seed: initialisation, data order (data.seed follows it), sampling
  c.compile_cache_dir = ""  # persistent XLA compilation cache directory ("" = off)
  # resume a workdir's checkpoint although fields outside trainer.harness.RESUMABLE_FIELDS
  # changed (by default the run stops and names them)
  c.allow_config_change = False

  c.model = _model()
  c.tokenizer = _tokenizer()
  c.mesh = _mesh()
  c.optimizer = _optimizer()
  c.loss = _loss()
  c.data = _data()
  c.train = _train()
  c.checkpoint = _checkpoint()
  c.metrics = _metrics()
  c.rl = _rl()
  c.distill = _distill()
  c.eval = _eval()
  c.serve = _serve()
  c.reward_model = _reward_model()
  c.data.seed = c.get_ref("seed")  # shuffle seed (follows `seed` unless set)
  c.optimizer.total_steps = c.train.get_ref("steps")  # the schedule spans the run
  return c


def for_family(family: str | None, mode: str) -> ml_collections.ConfigDict:
  """`base_config()` for a model imported from Hugging Face, sized for a TPU slice.

  Args:
    family: a FAMILIES key (None: "qwen2.5-coder"): the chat format and an example checkpoint.
    mode: the run's mode.

  Raises:
    ValueError: an unknown family.
  """
  family = family or "qwen2.5-coder"
  if family not in FAMILIES:
    raise ValueError(f"configs/{mode}.py:{family}: expected one of {sorted(FAMILIES)}")
  chat_format, example = FAMILIES[family]
  c = base_config()
  c.mode = mode  # "sft" | "rl" (configs/distill.py starts from configs/rl.py)
  c.seed = 0  # the run's seed
  c.model.init = f"hf:{example}"  # hf:<HF checkpoint dir> or ckpt:<Arbor workdir / import dir>
  c.model.preset = ""  # the checkpoint defines the architecture
  c.model.overrides.dtype = "bfloat16"  # compute dtype (parameters stay fp32)
  c.model.overrides.remat = "full"  # recompute each block in the backward pass (long rows)
  c.model.overrides.attention_impl = "auto"  # the backend's tree-attention kernel
  c.tokenizer.path = ""  # "" = the checkpoint directory's tokenizer.json
  c.tokenizer.chat_format = chat_format  # how messages become token ids (envs/chat)
  c.mesh.fsdp = -1  # parameters sharded over all devices
  c.mesh.expert = 1  # MoE: expert parallelism (e.g. 8; then fsdp takes the remaining devices)
  return c


def _model() -> ml_collections.ConfigDict:
  """Weights and architecture: a preset (random init) or a checkpoint, plus overrides."""
  s = ml_collections.ConfigDict()
  s.init = "random"  # "random" (preset) | "hf:<dir>" (HF checkpoint) | "ckpt:<dir>" (below)
  # models/presets.py name, for init="random"; must be "" otherwise (the checkpoint says)
  s.preset = "tiny-moe-mla"
  # ModelConfig fields changed on top of the preset / checkpoint; None = keep. Config files may
  # add any other ModelConfig field here (the command line can only set fields that exist).
  s.overrides = ml_collections.ConfigDict()
  s.overrides.dtype = placeholder(str)  # compute dtype: "float32" | "bfloat16" | "float16"
  s.overrides.remat = placeholder(str)  # "none" | "full" | "save_dots" | "offload"
  s.overrides.attention_impl = placeholder(str)  # "xla" | "xla_flash" | "pallas_*" | "auto"
  s.overrides.moe_impl = placeholder(str)  # "ragged" | "dense"
  s.overrides.moe_dispatch = placeholder(str)  # "auto" | "global" | "all_to_all" (experts)
  s.overrides.moe_dispatch_chunk = placeholder(int)  # all_to_all: tokens per device per round
  s.overrides.logits_chunk = placeholder(int)  # tokens per vocabulary-projection chunk
  # sharding rules replaced by name (models/config.py DEFAULT_SHARDING_RULES): logical axis ->
  # mesh axes, "tensor", "fsdp,expert" or "" (replicated); None = keep. act_embed="tensor"
  # splits the residual stream, hence the layer inputs full remat saves, over tensor
  s.overrides.sharding_rules = ml_collections.ConfigDict()
  s.overrides.sharding_rules.act_embed = placeholder(str)  # the residual stream's hidden axis
  # LoRA / QLoRA (models/lora.py, through qwix): the base frozen, low-rank adapters trained;
  # checkpoints hold the adapters and refer to model.init for the base
  s.lora = ml_collections.ConfigDict()
  s.lora.rank = 0  # adapter rank; 0 = full fine-tuning
  s.lora.alpha = 16.0  # adapters' output scale alpha / rank
  s.lora.rslora = False  # rank-stabilised LoRA: output scale alpha / sqrt(rank) instead
  s.lora.dropout = 0.0  # dropout on the adapters' input, in training steps only
  # what gets adapters: attention | mlp (dense MLPs, shared experts) | experts (routed experts)
  s.lora.modules = "attention,mlp"
  s.lora.experts = "per_expert"  # routed experts' adapters: "per_expert" | "shared" by a layer
  s.lora.base_qtype = placeholder(str)  # QLoRA: the frozen base stored as "int8" | "int4" |
  #                                       "float8_e4m3fn" | "float8_e5m2"; None = its dtype
  return s


def _tokenizer() -> ml_collections.ConfigDict:
  """The tokenizer and the chat format that renders messages to token ids (envs/chat)."""
  s = ml_collections.ConfigDict()
  # tokenizer dir or file (tokenizer.json / tokenizer.model / tiktoken); "" = the trained demo
  # tokenizer (train_vocab_size > 0), else the checkpoint's (hf:DIR, ckpt:DIR)
  s.path = ""
  # envs.chat: "template" (the checkpoint's own Jinja chat_template, run as transformers does)
  # or a built-in format: "chatml" | "qwen2.5" | "deepseek_v3" | "plain"
  s.chat_format = "chatml"
  s.template_kwargs = {}  # for "template": e.g. {"enable_thinking": False} (Qwen3)
  # > 0 (and path ""): train a sentencepiece BPE of this size on demo text into <workdir>/tokenizer
  s.train_vocab_size = 0
  s.train_episodes = 64  # scripted demo episodes whose text trains that tokenizer
  return s


def _mesh() -> ml_collections.ConfigDict:
  """Device mesh axis sizes; -1 = the remaining devices (models/sharding.py)."""
  s = ml_collections.ConfigDict()
  s.data = 1  # pure data parallelism (replicated parameters)
  s.fsdp = -1  # data parallelism with sharded parameters; -1 = all remaining devices
  s.tensor = 1  # tensor parallelism (heads, MLP width, vocabulary)
  s.expert = 1  # expert parallelism (MoE experts)
  s.sequence = 1  # context parallelism: each row's tokens split over devices (divides row_len)
  return s


def _optimizer() -> ml_collections.ConfigDict:
  """The optimizer (trainer/optim): AdamW, Muon, MuonClip; schedule, clipping, state dtype."""
  s = ml_collections.ConfigDict()
  s.name = "muon"  # "adamw" | "muon" | "muon_clip" (Muon+QK-Clip) | "adamw_clip" (AdamW+QK-Clip)
  s.learning_rate = 2e-4  # peak learning rate (Muon and AdamW share it under the moonlight rule)
  s.schedule = "cosine"  # "constant" | "cosine" | "linear" | "wsd" (warmup-stable-decay)
  s.warmup_steps = 0  # linear warmup steps: lr(step) = peak·(step+1)/warmup_steps
  s.total_steps = 1000  # schedule length (cosine/linear/wsd reach end_lr_ratio·peak here)
  s.end_lr_ratio = 0.1  # final learning rate as a fraction of the peak (cosine/linear/wsd)
  s.wsd_decay_fraction = 0.2  # wsd: fraction of total_steps spent in the final decay
  s.wsd_decay_shape = "linear"  # wsd: "linear" | "cosine" decay from the peak to the end value
  s.b1 = 0.9  # AdamW β1
  s.b2 = 0.95  # AdamW β2 (optimizer "adamw")
  s.eps = 1e-8  # AdamW ε
  s.weight_decay = 0.1  # decoupled weight decay λ (W ← W − lr·λ·W): matrices and embeddings
  s.weight_decay_norms = False  # also decay RMSNorm gains (Moonlight appendix D); never biases
  s.grad_clip_norm = 1.0  # clip the accumulated gradient to this global norm; 0 = no clipping
  s.state_dtype = "float32"  # optimizer moments: "float32" | "bfloat16" (computed in fp32)
  s.muon = ml_collections.ConfigDict()
  s.muon.beta = 0.95  # Muon momentum (EMA, bias-corrected, as optax.contrib.scale_by_muon)
  s.muon.nesterov = True  # Nesterov momentum for the Muon branch
  s.muon.ns_steps = 5  # Newton–Schulz iterations
  s.muon.scale_rule = "moonlight"  # "moonlight" rms·√max(in, out) | "keller" √max(1, out/in)
  s.muon.rms = 0.2  # moonlight rule: target update RMS (0.2 matches AdamW, so lr and λ carry over)
  s.muon.adam_b2 = 0.95  # β2 of the AdamW branch (embeddings, lm_head, norms, biases, routers)
  # peak learning rate of the AdamW branch; None = learning_rate
  s.muon.adam_learning_rate = placeholder(float)
  s.muon.per_head_attention = False  # orthogonalise attention projections per head, not whole
  s.qk_clip = ml_collections.ConfigDict()
  s.qk_clip.tau = 100.0  # clip heads whose max pre-softmax logit exceeds τ (Kimi K2: 100)
  s.qk_clip.alpha = 0.5  # balance: queries take γ^α, keys γ^(1−α) (MLA rotary query takes γ)
  return s


def _loss() -> ml_collections.ConfigDict:
  """rl.losses.LossConfig fields; None = the loss's paper default."""
  s = ml_collections.ConfigDict()
  s.name = "sft"  # rl.losses.LOSSES key; mode "sft" takes "sft"
  s.aggregation = placeholder(str)  # rl.losses.AGGREGATIONS / SEQ_AGGREGATIONS (sequence)
  s.eps_low = placeholder(float)  # lower clip: ratio >= 1 - eps_low
  s.eps_high = placeholder(float)  # upper clip: ratio <= 1 + eps_high
  s.dual_clip = placeholder(float)  # PPO dual clip c > 1
  s.max_len = 0  # Dr.GRPO constant normaliser L (seq_mean_token_sum_norm)
  s.kl_coef = 0.0  # β of the KL-to-reference penalty (the rl.reference policy scores)
  s.kl_estimator = "k3"  # "k1" | "k2" | "k3" | "k3_is"
  s.entropy_coef = 0.0  # entropy bonus coefficient
  s.behaviour_cap = placeholder(float)  # decoupled PPO: cap on π_old/μ
  s.decoupled = False  # decoupled PPO: weight each token by π_old/μ (needs rl.recompute_old)
  s.turn_ratio = "product"  # turn_gspo: "product" | "geometric_mean"
  s.cispo_masked = False  # CISPO unified form with the PPO-style token mask
  s.tau = 1.0  # kimi_pmd regulariser τ
  s.opd_coef = 0.0  # add coef · OPD (needs the distill teachers)
  s.dpo_beta = 0.1  # DPO β
  s.mask_failed_turns = False  # also drop failed tool-call turns in the loss (data flags)
  s.entropy_adv_coef = placeholder(float)  # aepo: α of the entropy-aware advantage A·(1 + α·Ĥ)
  return s


def _data() -> ml_collections.ConfigDict:
  """SFT data (trainer.data.SFTDataConfig, the fixed shape of a step), held-out files, demo data."""
  s = ml_collections.ConfigDict()
  s.sources = ()  # training files: *.jsonl / *.parquet / *.msgpack, e.g. "('a.jsonl',)"
  s.eval_sources = ()  # held-out files for the eval loss (same formats)
  s.row_len = 2048  # L: tokens per packed row (multiple of 128; longest LLM call fits)
  s.rows_per_batch = 2  # R: rows per micro-batch (a multiple of mesh data x fsdp x expert)
  s.microbatches = 1  # M: micro-batches per step, summed into one update
  s.max_seqs = 8  # S: trajectories per micro-batch at most
  s.seq_len = 512  # T: trained tokens per trajectory at most
  s.shuffle = True  # shuffle groups, differently every epoch
  s.num_epochs = 0  # passes over the data; 0 = repeat until train.steps
  s.group_by = "system"  # records in one tree: "field" | "prompt" | "system" | "none"
  s.max_group_size = 4  # records per tree at most (0 = whole groups)
  s.mask_tool_errors = True  # error-masked SFT: failed tool-call turns stay out of the loss
  s.skip_bad = False  # log and count bad records instead of failing
  s.num_threads = 1  # threads rendering records ahead of the packer
  s.prefetch = 16  # groups rendered ahead
  s.demo = ml_collections.ConfigDict()  # generated data (trainer/demo_data.py), no download
  s.demo.episodes = 0  # > 0: scripted demo episodes written to <workdir>/data/train.jsonl
  s.demo.eval_episodes = 0  # > 0: held-out episodes (taskgen "eval" programs)
  s.demo.level = 0  # envs.taskgen difficulty level: 0 | 1 | 2 | 3
  s.demo.seed = 0  # envs.taskgen seed of the tasks
  s.demo.error_rate = 0.25  # fraction of episodes with a failed (error-masked) tool call
  s.demo.early_submit_rate = 0.0  # fraction of episodes that submit without the fix
  s.demo.sandbox = "bwrap"  # where the scripted solver's tools run: "bwrap" | "local"
  s.demo.environment = ""  # their sandboxes' environment: "" | a preset | a spec file (as rl.)
  return s


def _train() -> ml_collections.ConfigDict:
  """Steps of the run and the eval / checkpoint / log intervals."""
  s = ml_collections.ConfigDict()
  s.steps = 100  # optimizer steps of the run (a resumed run continues to this many)
  s.eval_every = 0  # eval loss on held-out data every N steps and at the end (0 = never)
  s.eval_batches = 0  # held-out batches per eval (0 = all of them)
  s.checkpoint_every = 50  # checkpoint every N steps (0 = only at the end); SIGTERM saves too
  s.log_every = 10  # a log line every N steps (metrics are written every step)
  return s


def _checkpoint() -> ml_collections.ConfigDict:
  """Checkpoints kept and how they are written."""
  s = ml_collections.ConfigDict()
  s.keep = 3  # latest checkpoints kept (older ones are deleted)
  s.async_save = True  # write in the background while training continues
  return s


def _metrics() -> ml_collections.ConfigDict:
  """Where and how metrics are written, and the end-of-run report."""
  s = ml_collections.ConfigDict()
  s.dir = ""  # local directory for metrics.jsonl, events, report ("" = <workdir>/<mode>)
  s.tensorboard = True  # TensorBoard event files
  s.progress = True  # progress bar with rate and ETA on stderr (only on a terminal)
  s.wandb_project = ""  # Weights & Biases project ("" = off; needs wandb installed)
  s.report = True  # report.png + report.html at the end of the run
  return s


def _rl() -> ml_collections.ConfigDict:
  """The RL loop (trainer/rl.py): rollouts, groups, advantages, mismatch corrections, sandboxes."""
  s = ml_collections.ConfigDict()
  s.loop = "sync"  # "sync" (generate, then train) | "async" (overlapped, bounded staleness)
  s.max_staleness = 1  # async / queue: at most k policy versions between rollout and trainer
  s.prompts_per_step = 8  # tasks (groups) per optimizer step
  s.group_size = 8  # samples per task (G)
  s.epochs = 1  # passes over each step's rollouts
  s.minibatches = 1  # optimizer updates per pass
  # True: every step's micro-batches take one shape, from the bounds of rl.prompts_per_step,
  # group_size, minibatches, max_turns and max_new_tokens (one compile per run, padding skipped
  # at run time); False: sized from each step's data, rounded up to powers of two
  s.fixed_batch_shape = False
  # rl.advantages: "grpo" | "dr_grpo" | "rloo" | "reinforce_pp_baseline" per trajectory,
  # "treerl" per call: the tree's segment values (branching rollouts; independent: 2·(r - mean)),
  # or "gae" per token from a learned critic (trainer.critic; one device, no LoRA)
  s.advantage = "grpo"
  s.gae_gamma = 1.0  # "gae": discount γ per sampled token
  s.gae_lambda = 0.95  # "gae": λ of the advantage estimate (1 = Monte Carlo, 0 = one-step TD)
  s.value_clip = 0.2  # "gae": ε of the clipped value loss around the old values (0 = no clip)
  s.critic_lr = 1e-5  # "gae": the critic's Adam learning rate
  s.critic_warmup_steps = 0  # "gae": the first steps train the critic only, not the policy
  s.critic_epochs = 0  # "gae": the critic's passes over a step's micro-batches (0 = rl.epochs)
  s.drop_constant_groups = True  # drop groups whose rewards are all equal (no signal)
  # grade each distinct submission once: a task's episodes that end with identical workspaces
  # (or programs) share one test run (envs.verifiers.cache; flaky tests get one draw for them)
  s.cache_verdicts = True
  s.reference = "initial"  # KL reference (loss.kl_coef > 0): "initial" policy | "ckpt:<dir>"
  s.recompute_old = False  # score π_old with the trainer instead of trusting the sampler's
  s.correction = "none"  # mismatch correction: rl.corrections.KINDS (needs recompute_old / MCLA)
  s.mcla_passes = 0  # MCLA scoring passes averaged for π_old (0 = off)
  s.mcla_mode = "logprob"  # MCLA average: "logprob" | "prob"
  s.routing_replay = True  # MoE policies: the training forward replays the engine's experts
  s.temperature = 1.0  # sampling temperature (0 = greedy)
  s.top_p = 1.0  # nucleus mass (1 = off)
  s.top_k = 0  # top-k (0 = off)
  s.max_new_tokens = 512  # tokens sampled per LLM call at most
  s.max_turns = 6  # agent turns per episode
  s.max_context_tokens = 8192  # one call's input + output at most
  s.sandbox = "bwrap"  # sandbox backend: "bwrap" | "local" | "docker" | "remote"
  s.sandbox_url = ""  # rl.sandbox="remote": the sandbox server, http(s)://host:port
  s.sandbox_token_file = ""  # rl.sandbox="remote": file holding the server's bearer token
  s.rollout_workers = "inprocess"  # "inprocess" (asyncio) | "queue" (remote workers)
  s.episode_timeout_s = 600.0  # wall-clock limit of one episode (termination "timeout")
  s.concurrency = 8  # in-process episodes run at once
  # the engine's KV cache: "contiguous" (a row of max_context_tokens per slot) | "paged"
  # (fixed-size pages shared copy-on-write across a group's prompt and branched turns)
  s.kv_cache = "contiguous"
  s.kv_page_size = 16  # rl.kv_cache="paged": positions per page
  s.kv_pages = 0  # rl.kv_cache="paged": pages per layer (0 = the contiguous cache's memory)
  # where the engine decodes: "none" (one device) | "colocated" (the trainer's mesh, in the
  # engine's decode layout: weights tensor/expert-parallel, slots over the data axes)
  s.engine_mesh = "none"
  # rl.engine_mesh="colocated": the trainer's devices laid out anew for decoding, e.g.
  # "tensor=4" (those axes' sizes, fsdp the rest; fewer batch shards, each with more slots and
  # a quarter of the weights); "" = the trainer's mesh as it is
  s.engine_mesh_shape = ""
  # the engine samples from a weight-only quantized copy of the policy (qwix: "int8" |
  # "float8_e4m3fn" | ...), re-quantized at every weight sync; None = the training weights.
  # The sampler's log-probs are the quantized policy's: pair with rl.recompute_old and
  # rl.correction (icepop, tis_*)
  s.rollout_qtype = placeholder(str)
  # with rollout_qtype: also quantize the projections' inputs ("int8" | "float8_e4m3fn" |
  # "float8_e5m2", per token at every call); None = weight-only
  s.rollout_act_qtype = placeholder(str)
  s.queue_url = ""  # queue workers: "memory" | redis://host:port | rediss://... ("" = memory)
  s.queue_password_file = ""  # file holding the Redis password ("" = none)
  # queue: a group still short this long after its first member arrived is dropped
  s.group_deadline_s = 600.0
  s.tasks = ""  # task JSONL / SWE Parquet file (envs.tasks); "" = generated tasks (envs.taskgen)
  # SWE-bench rows (repo + base_commit) of rl.tasks and eval.tasks check out from git mirrors
  s.swe_mirror = ""  # dir of owner__name.git mirrors ("" = $ARBOR_SWE_MIRROR)
  s.swe_cache = ""  # where checkouts go ("" = $ARBOR_SWE_CACHE, else ~/.cache/arbor/swe)
  # where SWE rows (rl.tasks, eval.tasks) without an `environment` get one: "none" (the
  # sandbox's own root) | "swebench" (its install table: $ARBOR_SWEBENCH_SPECS) | "repository"
  s.env_from = "none"
  # the environment of every other task without one (generated tasks, problems): "" (none),
  # a preset of envs.task_environments ("bookworm-pytest") or a .json / .toml spec file
  s.default_environment = ""
  s.task_level = 0  # generated tasks: taskgen level 0 | 1 | 2 | 3
  s.task_seed = 1  # generated tasks: taskgen seed (disjoint from the SFT demo's)
  # a group: "independent" (G episodes) | "branching" (one entropy-guided tree of G leaves)
  s.rollout = "independent"
  # the agent loop of each task's episodes (envs.scaffolds.REGISTRY): "react" (Arbor's loop) or
  # a black-box CLI ("mini-swe-agent", "claude-code", ...; bwrap/docker sandboxes, in-process
  # rollouts), or a weighted mix "react:0.5,mini-swe-agent:0.5" drawn per task from its id and
  # the seed; a task row's own "scaffold" field wins
  s.scaffold = "react"
  s.branch = _branch()  # tree rollouts (rl.rollout = "branching"): envs.branching.BranchConfig
  s.reward_model = _rl_reward_model()  # a trained reward model's score added to the reward
  s.judge_reward = _rl_judge_reward()  # an LLM judge's rubric score added to the reward
  return s


def _rl_reward_model() -> ml_collections.ConfigDict:
  """A reward model in the RL loop (trainer.reward_model.Scorer): verifier reward + weight x RM."""
  s = ml_collections.ConfigDict()
  s.path = ""  # a mode "reward_model" workdir ("" = no reward model); the policy's tokenizer
  s.weight = 0.5  # w: reward = verifier reward + w x σ(RM score) (kind "orm")
  # "orm": the trajectory's score enters its reward; "prm": per step, w x the centred return of
  # the step scores is added to each call's advantage (with rl.advantage="gae": the trajectory's
  # score enters its reward, as "orm")
  s.kind = "orm"
  return s


def _rl_judge_reward() -> ml_collections.ConfigDict:
  """A generative reward in the RL loop (trainer.judge_rewards): verifier reward + weight x the
  rubric score an LLM judge gives each episode, in [0, 1]."""
  s = ml_collections.ConfigDict()
  s.weight = 0.0  # w: reward = verifier reward + w x judge score (0 = no judge)
  # the judge: "policy" (the policy grades itself, same engine), "ckpt:<dir>" (a checkpoint in
  # its own engine) or an OpenAI-compatible completions URL "http://host:port/v1" (token ids
  # in and out); it must share the policy's tokenizer and chat format
  s.source = "policy"
  s.model = "arbor"  # the served model's name at an http(s) source
  # the dimensions, "name:weight:description", each scored 0-10 (envs.verifiers.judge)
  s.rubric = ("correctness:2:the changes do what the task asks and break nothing else",
              "minimal_edit:1:the diff touches only what the fix needs, no unrelated changes",
              "process:1:each step is purposeful: no needless, repeated or wrong actions")
  s.max_retries = 2  # re-asks after an unparseable, failed or timed-out reply
  s.fallback = "skip"  # after the retries: "skip" (reward = verifier's) | "group_mean"
  s.concurrency = 16  # judge requests in flight at once
  s.timeout_s = 120.0  # seconds one judge reply may take (then it counts as failed)
  s.max_tokens = 256  # the judge reply's token budget (greedy)
  s.max_chars = 6000  # the tail of each episode's transcript the judge sees
  s.cache_size = 65536  # scores kept in memory (LRU) by content hash (0 = no cache)
  # scores kept on disk (JSONL; relative: under the workdir; "" = in memory only), read back
  # when a run resumes
  s.cache_file = "judge_cache.jsonl"
  return s


def _branch() -> ml_collections.ConfigDict:
  """Entropy-guided branching (ARPO / AEPO): where a group's episodes fork."""
  s = ml_collections.ConfigDict()
  s.width = 2  # paths leaving a branch point (the path itself + width - 1 new ones)
  s.base_prob = 0.5  # branch probability of a tool step as uncertain as the question
  s.entropy_weight = 0.2  # probability added per nat of step entropy above the question's
  s.consecutive_penalty = 0.5  # each consecutive branch on a path scales it by 1 - this
  s.premonitor_beta = 1.0  # global samples m = G·σ(β·(H_question - mean H_tool steps))
  s.global_fraction = placeholder(float)  # fixed m = G·fraction instead of pre-monitoring
  s.entropy_tokens = 20  # a step's entropy: over the first tokens of its reply
  # "nats" (mean exact entropy per token) | "arpo" (ARPO's: top-k entropies summed over those
  # tokens, over ln(vocabulary size); the engine then reports entropy_top_k log-probs)
  s.entropy_measure = "nats"
  s.entropy_top_k = 10  # "arpo": log-probs per token
  s.reset_root = False  # a branch's root entropy = its own first call's (ARPO)
  s.premonitor = True  # AEPO's first global sample alone; False: global samples start at once
  return s


def _distill() -> ml_collections.ConfigDict:
  """On-policy distillation (mode "distill"): the domain experts that score the student."""
  s = ml_collections.ConfigDict()
  s.teachers = ()  # teacher checkpoints "domain=ckpt:<dir>" (one per domain expert)
  s.choose = "by_domain"  # teacher per task: "by_domain" (task domain) | "single"
  s.opd_coef = 1.0  # weight of the OPD term added to the RL loss
  return s


def _eval() -> ml_collections.ConfigDict:
  """Held-out evaluation (mode "eval", trainer/evaluate.py): pass@k, test-time selection."""
  s = ml_collections.ConfigDict()
  # Held-out tasks: "" = generated (distinct taskgen "eval" programs), or a comma-separated
  # list of task files/directories (envs.episode.load_task_file) and "generated".
  s.tasks = ""
  s.num_tasks = 200  # held-out tasks evaluated (per entry of eval.tasks)
  s.k = 1  # pass@k
  s.samples = 1  # samples per task (n >= k)
  s.selection = "none"  # test-time: "none" | "best_of_n" | "majority_vote" | "self_play"
  s.temperature = 0.0  # eval sampling temperature (0 = greedy)
  s.scaffold = "react"  # the eval's scaffold or weighted mix, as rl.scaffold (pass@k per scaffold)
  s.checkpoints = ()  # checkpoints to evaluate ("ckpt:<dir>"); () = this run's latest
  return s


def _reward_model() -> ml_collections.ConfigDict:
  """Mode "reward_model" (trainer/reward_model.py): data, losses and batches of its training."""
  s = ml_collections.ConfigDict()
  s.episodes = ""  # training trajectories (JSONL of Trajectory.to_dict); "" = demo episodes
  s.eval_episodes = ""  # held-out trajectories (same format); "" = demo episodes
  # "" files: per generated task (data.demo level, seed, error_rate, sandbox, environment) the
  # scripted solver's episode with the fix and one submitting without it, graded by the tests
  s.demo_tasks = 128  # training tasks (taskgen "train" programs): 2 episodes each
  s.demo_eval_tasks = 64  # held-out tasks (taskgen "eval" programs): 2 episodes each
  s.pairwise_coef = 1.0  # weight of the Bradley-Terry loss on (passed, failed) pairs of a task
  s.orm_coef = 1.0  # weight of the outcome BCE on each episode's verifier outcome
  s.prm_coef = 0.0  # weight of the per-step BCE (step label: outcome; failed tool call: 0)
  s.margin = 0.0  # Bradley-Terry margin m: -log σ(r_chosen - r_rejected - m)
  s.batch_pairs = 4  # pairs per step (2x rows: chosen and rejected episodes)
  s.max_len = 2048  # tokens per episode at most (longer ones keep their last max_len)
  s.learning_rate = 1e-4  # AdamW learning rate (constant; gradients clipped to norm 1)
  s.weight_decay = 0.0  # AdamW weight decay
  return s


def _serve() -> ml_collections.ConfigDict:
  """The policy server (mode "serve", trainer/serve.py)."""
  s = ml_collections.ConfigDict()
  s.host = "127.0.0.1"  # bind address; any other needs a token ($ARBOR_SERVE_TOKEN)
  s.port = 8000  # port (0 = any free port)
  s.served_name = "arbor"  # the "model" field of chat replies
  s.slots = 16  # sequences decoded together
  s.max_seq_len = 4096  # longest input + output
  s.top_logprobs = 20  # most alternatives per token a request may ask for (OpenAI's limit)
  s.max_connections = 1024  # open connections; beyond, idle ones are closed (tokenless first)
  s.header_timeout_s = 10.0  # a request's headers are due this long after connect / last reply
  s.body_timeout_s = 30.0  # a request's body is due this long after its headers (else 408)
  return s
