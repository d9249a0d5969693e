"""Build script: the Python packages come from pyproject.toml; this adds the C++/CUDA extension (csrc/)."""
from setuptools import setup

setup()
