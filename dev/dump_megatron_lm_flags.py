"""Writes the flag table of a Megatron-LM release (every option of its parser: name, how many
values it takes, its default) that `megatron/training/flags/megatron_lm_core_v0.19.0.tsv` holds
(its first line, a comment, names the release).

Run in an environment where that release's `megatron.training.arguments` imports (torch,
Triton, Python 3.12 or the `typing.override` stand-in below), e.g. the megatron-core reference
venv of scripts/setup_mcore_venv.sh with `pip install triton`, and a checkout of the release:
  git -C Megatron-LM archive core_v0.19.0 | tar -x -C /tmp/mlm
  PYTHONPATH=/tmp/mlm .venv-mcore/bin/python dev/dump_megatron_lm_flags.py core_v0.19.0 > table.tsv
"""

import argparse
import sys
import typing

typing.override = getattr(typing, "override", lambda function: function)  # Python 3.11

ZERO_VALUE_ACTIONS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse.BooleanOptionalAction,
)


def main() -> None:
    release = sys.argv[1]
    sys.argv = sys.argv[:1]
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    rows = set()
    for action in parser._actions:
        if isinstance(action, ZERO_VALUE_ACTIONS):
            arity = "0"
        else:
            arity = "1" if action.nargs is None else str(action.nargs)
        for flag in action.option_strings:
            if flag.startswith("--"):
                rows.add((flag, arity, repr(action.default)[:60]))
    print(f"# Megatron-LM {release}: flag, number of values (0, 1, N, ?, *, +), default")
    for row in sorted(rows):
        print("\t".join(row))


if __name__ == "__main__":
    main()
