"""Launch shims that run other projects' own tests against hf_elixir (see accelerate_shim.py)."""
