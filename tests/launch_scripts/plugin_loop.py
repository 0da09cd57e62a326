"""``plain_loop.py`` with ``ElixirPlugin().prepare`` written in: the reference for the routed run."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plain_loop import main  # noqa: E402

from hf_elixir.integrations import ElixirPlugin  # noqa: E402

if __name__ == "__main__":
    main(prepare=ElixirPlugin().prepare)
