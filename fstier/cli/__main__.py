"""``python -m fstier.cli``: the same as the ``fstier`` console script."""

import os

from fstier.cli import main

if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(prog_name="fstier")
