"""``python -m gpucourse`` (and ``torchrun -m gpucourse``) is the ``gpucourse`` command."""

import sys

from .cli import main

sys.exit(main())
