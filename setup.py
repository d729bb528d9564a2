"""Build script for the optional native block I/O extension.

Everything else is declared in pyproject.toml. The extension needs only a C
compiler and Python's headers; ``optional=True`` lets the install succeed
without them (fstier then runs its pure-Python I/O path and says so once at
tier start, in ``fstier bench`` and in the metrics).
"""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux") and sys.byteorder == "little":
    ext_modules.append(
        Extension(
            "fstier.io._native",
            sources=["fstier/io/_native.c"],
            depends=["fstier/io/_native_xxh3.h", "fstier/io/_native_engine.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
