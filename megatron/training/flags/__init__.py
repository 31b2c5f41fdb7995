"""Flags to typed configs: argument definitions (arguments.py), the Megatron-LM flag table
(megatron_lm.py), the checks (checks.py) and the typed configs built from them (configs.py,
run_config.py)."""
