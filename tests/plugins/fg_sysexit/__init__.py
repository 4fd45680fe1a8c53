"""A plugin whose module runs a command-line parser at import: under pytest (or any program with its own
arguments) ``parse_args`` exits with SystemExit(2). Loading it must not end the user's process."""
import argparse

parser = argparse.ArgumentParser(prog="fg_sysexit")
parser.add_argument("--required-flag", required=True)
ARGS = parser.parse_args()
