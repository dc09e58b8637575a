"""Only the package mapping lives here: the top-level ``kernels/`` folder installs as
``srot_fast.kernels`` (never as a top-level ``kernels`` module; a PyPI project of that name exists).
Everything else is in pyproject.toml."""
from setuptools import setup

setup(
    packages=["srot_fast", "srot_fast.kernels", "srot_fast.kernels.triton", "srot_fast.experiments"],
    package_dir={
        "srot_fast": "srot_fast",
        "srot_fast.kernels": "kernels",
        "srot_fast.kernels.triton": "kernels/triton",
    },
    package_data={"srot_fast.kernels": ["csrc/*.cpp"]},
)
