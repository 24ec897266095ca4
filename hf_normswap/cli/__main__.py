"""``python -m hf_normswap.cli``: the ``normswap`` command."""

import sys

from . import main

sys.exit(main())
