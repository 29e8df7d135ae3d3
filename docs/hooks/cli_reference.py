"""mkdocs hook: the command-line reference (docs/reference/cli.md) is generated at build time from
the argparse parsers of bert_fast/cli.py (and the training CLI's own parser), never copied by hand.

In a page, the line ``<!-- cli-reference -->`` is replaced by one section per command with its
``--help`` text, formatted at a fixed width so that the page does not depend on the terminal.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-reference -->"
WIDTH = "100"


def _help(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return parser.format_help().rstrip()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def commands():
    """(name, help text) of ``bert-fast`` and each of its subcommands, in the parser's order."""
    from bert_fast import cli

    parser = cli.build_parser()
    out = [("bert-fast", _help(parser))]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        if name == "train":  # the training CLI owns its parser (bert-fast train ARGS... is handed over)
            from bert_fast.training import cli as train_cli

            p = train_cli.build_parser()
            p.prog = "bert-fast train"
        out.append((f"bert-fast {name}", _help(p)))
    return out


def render() -> str:
    parts = []
    for name, text in commands():
        parts += [f"## `{name}`", "", "```text", text, "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files, **kwargs):  # noqa: ARG001 - mkdocs hook signature
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, render())
    return markdown
