"""A disk-tier setting that cannot take effect is refused at ``ElixirConfig(...)``, naming the field, the value and
the fix, instead of being silently ignored (docs/disk.md)."""

from __future__ import annotations

import pytest

from hf_elixir import ElixirConfig


def test_offload_dir_without_host_optimizer_state_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"ElixirConfig.offload_dir='.*' is set with offload_optimizer=False.*"
                                         r"set offload_optimizer=True \(or 'auto'\), or leave offload_dir=None"):
        ElixirConfig(offload_dir=str(tmp_path), offload_optimizer=False)
    for value in (True, "auto"):  # the two settings that keep optimizer state on the host
        assert ElixirConfig(offload_dir=str(tmp_path), offload_optimizer=value).offload_dir == str(tmp_path)
