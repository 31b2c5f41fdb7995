"""`pip install .` and `python setup.py ...` entry point, as Megatron-LM has one.

Everything (name, version, dependencies, extras, packages) lives in pyproject.toml; setuptools
reads it from there, so this file only hands over to it.
"""

from setuptools import setup

setup()
