"""Which parameters are carriers: frozen parametrizations' originals, such as an NF4 weight's packed bytes ([Note: NF4
in chunks] in ``_nf4.py``), which get chunks of their own ([Note: carriers in frozen chunks] there). Both the chunks
``prepare`` builds (``_build.comm_buckets``) and the search's packing of a profile (names only) ask this, so they lay
out the same chunks."""

from __future__ import annotations

__all__ = ["is_carrier_name"]


def is_carrier_name(name: str, requires_grad: bool) -> bool:
    """Is the parameter called ``name`` (its canonical name) a frozen parametrization's original?"""
    return not requires_grad and name.endswith(".original") and ".parametrizations." in name
