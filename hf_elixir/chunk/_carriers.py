"""Which parameters are carriers: frozen parametrizations' originals, such as an NF4 weight's packed bytes ([Note: NF4
in chunks] in ``_nf4.py``), which are exported in the compute dtype (``runtime/_exports.py``). Like every frozen
parameter they get chunks of their own ([Note: frozen chunks apart] in ``_frozen_apart.py``)."""

from __future__ import annotations

__all__ = ["is_carrier_name"]


def is_carrier_name(name: str, requires_grad: bool) -> bool:
    """Is the parameter called ``name`` (its canonical name) a frozen parametrization's original?"""
    return not requires_grad and name.endswith(".original") and ".parametrizations." in name
