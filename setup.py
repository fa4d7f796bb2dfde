from setuptools import find_packages, setup

setup(
    name="cpsr_ds",
    version="0.1.0",
    description="Controlled Predicting-assisted Self-Recovery (CPSR) for DeepSpeed training",
    packages=find_packages(include=["cpsr_ds", "cpsr_ds.*"]),
    python_requires=">=3.10",
    # torch is pinned by the Makefile before this installs; a range keeps pip from
    # replacing the CPU wheel with a CUDA build.
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.19,<0.20",
        "megatron-core>=0.16",
        "numpy",
        "scipy",
        "pydantic>=2",
        "xxhash",
        "tqdm",
    ],
    extras_require={"test": ["pytest", "pytest-xdist"], "bench": ["matplotlib"], "docs": ["mkdocs-material"],
                    # The Hugging Face examples (examples/hf_gpt2) and cpsr_ds.integration.huggingface.
                    "hf": ["transformers==4.57.6", "accelerate==1.15.0"]},
)
