"""Arbor: JAX/TPU post-training for agentic-coding LLMs (see docs/design.md)."""

from setuptools import find_packages, setup

# Lower bounds are the versions we test with (requirements-lock.txt pins them exactly);
# upper bounds stop at the next release line that may break the API.
JAX = "jax>=0.10.2,<0.11"

setup(
    name="arbor",
    version="0.1.0",
    description="JAX research codebase for post-training LLMs: SFT, RL with verifiable rewards, distillation.",
    python_requires=">=3.10",
    packages=find_packages(
        include=[
            "models", "models.*",  # models.kernels among them
            "rl", "rl.*",
            "envs", "envs.*",
            "trainer", "trainer.*",
            "launch", "launch.*",
            "configs", "configs.*",
        ]
    ),
    # Bundled example tasks (SWE-format repositories, code problems, LiveCodeBench rows,
    # Terminal-Bench-style shell tasks) and the PyPI sdists tasks are synthesized from.
    package_data={"envs": [
        "data/*.jsonl", "data/swe/*.jsonl", "data/swe/repos/**/*",
        "data/livecodebench/*.jsonl",
        "data/terminal_bench/*/*.yaml", "data/terminal_bench/*/*.sh",
        "data/terminal_bench/*/tests/*",
        "data/pypi/*.json", "data/pypi/*.md", "data/pypi/*.tar.gz",
        "data/pypi/sample/*.jsonl", "data/pypi/sample/repos/*.tar.gz",
        "chat/templates/*.jinja",
    ]},
    install_requires=[
        JAX,
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        # LoRA / QLoRA adapters and quantized weights (models/lora.py)
        "qwix>=0.1.8,<0.2",
        "grain>=0.2.18,<0.3",
        "tensorstore>=0.1.86,<0.2",
        "sentencepiece>=0.2.3,<0.3",
        "ml-collections>=1.1.0,<2",
        "absl-py>=2.5.1,<3",
        "numpy>=2.4,<3",
        "safetensors>=0.8.0,<0.9",
        "docker>=7.2.0,<8",
        "msgpack>=1.2.4,<2",  # trajectory records (never pickle)
        "redis>=8.1.0,<9",  # Redis Streams rollout queue
        "tokenizers>=0.23.3,<0.24",  # envs.chat: Hugging Face tokenizer.json
        "tiktoken>=0.14.0,<0.15",  # envs.chat: Kimi K2 / Moonlight tokenizers
        "google-cloud-storage>=3.17.1,<4",
        "matplotlib>=3.11.2,<4",  # end-of-run report (trainer/report.py)
        "tqdm>=4.70,<5",  # progress bar
        "pyarrow>=26.0.1,<27",  # Parquet SFT data
        "jinja2>=3.1.6,<4",  # envs.chat: checkpoints' own chat templates
        "starlette>=1.10.0,<2",  # trainer.serve: the OpenAI-compatible policy server
        "llguidance>=1.9.1,<2",  # trainer.serving.constrain: grammar-constrained sampling
        "uvicorn>=0.54.0,<0.55",
        "pyyaml>=6.0.3,<7",  # envs.terminal_bench: task.yaml
    ],
    extras_require={
        # Tests compare against Hugging Face transformers on PyTorch CPU.
        "test": [
            "pytest>=9.2,<10",
            "pytest-xdist>=3.8,<4",
            "hypothesis>=6.170,<7",
            "torch==2.13.0",
            "transformers>=5.23,<6",
            # LoRA adapters in PEFT's format (models/peft_format.py) load in the real peft.
            "peft>=0.21.2,<0.22",
            # The policy server is driven by the official OpenAI and Anthropic clients;
            # SWE-bench rows are graded against the swebench package's own log parsers and
            # grading.
            "openai>=3.57.0,<4",
            "anthropic>=2.17.0,<3",
            "swebench>=5.0.2,<6",
            # The quickstart notebook runs under a real Jupyter kernel, as on Colab.
            "nbclient>=0.11,<0.12",
            "ipykernel>=7.4,<8",
            # libtpu: the XLA TPU compiler, for ahead-of-time compiles without a TPU.
            JAX.replace("jax", "jax[tpu]", 1),
        ],
        # gcsfs lets orbax/etils read and write gs:// workdirs.
        "tpu": [JAX.replace("jax", "jax[tpu]", 1), "gcsfs>=2026.9.0"],
        "gpu": [JAX.replace("jax", "jax[cuda12]", 1)],
    },
)
