"""``python -m gpucourse.cli``: the ``gpucourse`` command."""

import sys

from . import main

sys.exit(main())
