"""Build the C hot paths in native/ as extension modules of the packages that use them.

Each native module is one .c/.h pair in native/; the Python package that owns the
concept imports it (e.g. ``rdma.providers.soft`` imports ``rdma._soft_engine``).
After editing a .c file in a dev checkout: ``python setup.py build_ext --inplace``.
"""
from setuptools import Extension, setup

CFLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11"]

ext_modules: list[Extension] = [
    # rdma/ soft provider engine goes here: Extension("rdma._soft_engine", ["native/soft_engine.c"], ...)
]

setup(ext_modules=ext_modules)
