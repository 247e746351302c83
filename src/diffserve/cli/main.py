"""`diffserve` command line: dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys

from diffserve import __version__
from diffserve.cli import calibrate_cache, generate, make_lora, make_tiny, serve
from diffserve.logging_setup import configure_logging
from diffserve.process_start import start_method

EXIT_USER_ERROR = 2


class _TopLevelParser(argparse.ArgumentParser):
    """Reports an unrecognised flag in one line, with the closest flag of its subcommand (no usage dump)."""

    subcommands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        argv = sys.argv[1:] if args is None else list(args)
        command = next((arg for arg in argv if arg in self.subcommands), None)
        owner = self.subcommands.get(command or "", self)
        # Before parsing: a misspelled `--promt` would otherwise be reported as a missing `--prompt`.
        unknown = unrecognized_flags(owner, argv[argv.index(command) + 1 :] if command else argv)
        if unknown:
            _exit_with_error(unrecognized_message(owner, unknown))
        parsed, extra = self.parse_known_args(argv, namespace)
        if extra:
            _exit_with_error(f"unrecognized arguments: {' '.join(extra)} (see `{owner.prog} --help`)")
        return parsed


_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def unrecognized_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The arguments of `argv` that argparse would take for flags and that `parser` does not know (nor takes as
    an abbreviation of one of its flags); `--` ends the flags, negative numbers and text with spaces are values."""
    known = [flag for flag in parser._option_string_actions if flag.startswith("--")]
    unknown = []
    for arg in argv:
        if arg == "--":
            break
        if len(arg) < 2 or arg[0] != "-" or " " in arg or _NEGATIVE_NUMBER.match(arg):
            continue
        flag = arg.split("=", 1)[0]
        if flag in parser._option_string_actions:
            continue
        if arg.startswith("--"):
            if parser.allow_abbrev and any(option.startswith(flag) for option in known):
                continue
        elif arg[:2] in parser._option_string_actions:  # -x with its value attached (-xVALUE)
            continue
        unknown.append(flag)
    return unknown


def unrecognized_message(parser: argparse.ArgumentParser, flags: list[str]) -> str:
    """`unrecognized argument --heigth; did you mean --height?`, a suggestion per flag that has a close one."""
    options = [flag for flag in parser._option_string_actions if flag.startswith("--")]

    def suggestion(flag: str) -> str | None:
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
        return close[0] if close else None

    if len(flags) == 1:
        close = suggestion(flags[0])
        hint = f"did you mean {close}?" if close else f"see `{parser.prog} --help`"
        return f"unrecognized argument {flags[0]}; {hint}"
    described = [f"{flag} (did you mean {close}?)" if (close := suggestion(flag)) else flag for flag in flags]
    return f"unrecognized arguments {', '.join(described)}; see `{parser.prog} --help`"


def _exit_with_error(message: str) -> None:
    """One `error:` line and exit code 2, as a `UserError` is reported."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


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
        start_method()  # a bad DIFFSERVE_START_METHOD is refused before anything starts
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
