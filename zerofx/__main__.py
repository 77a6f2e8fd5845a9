"""Command line: ``python -m zerofx plan ...`` (see `zerofx.planning.cli`)."""

from __future__ import annotations

import argparse

from zerofx.planning import cli


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerofx")
    commands = parser.add_subparsers(dest="command", required=True)
    cli.add_arguments(commands.add_parser("plan", help="what one rank holds and sends, per ZeRO stage"))
    args = parser.parse_args(argv)
    try:
        print(cli.run(args))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
