"""`diffserve` command line: dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys

from diffserve import __version__
from diffserve.cli import calibrate_cache, generate, make_lora, make_tiny, serve
from diffserve.logging_setup import configure_logging

EXIT_USER_ERROR = 2


class _TopLevelParser(argparse.ArgumentParser):
    """Reports unrecognised arguments with the usage of the subcommand they were given to."""

    subcommands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = self.subcommands.get(getattr(parsed, "command", None) or "", self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = _TopLevelParser(prog="diffserve", description="A fast serving engine for diffusion models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, calibrate_cache, make_tiny, make_lora, serve):
        command.add_parser(sub)
    parser.subcommands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info")
    configure_logging(level)
    from diffserve.errors import UserError

    try:
        return args.handler(args)
    except UserError as exc:
        if level == "debug":
            logging.getLogger("diffserve").exception("error")
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
