"""``python -m kd.demo [--output-dir D] [--quick] [--seed N]``: the same as ``kd demo``."""

import argparse
import sys

from kd.demo import add_parser, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kd.demo")
    add_parser(parser.add_subparsers())
    sys.exit(run(parser.parse_args(["demo", *sys.argv[1:]])))
