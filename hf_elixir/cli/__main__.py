"""``python -m hf_elixir.cli``: the ``hf-elixir`` command."""

import sys

from hf_elixir.cli import main

sys.exit(main())
