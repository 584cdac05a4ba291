"""Command line of ``tools/fork``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from forklib import ForkError, commands
from forklib.layout import Layout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/fork",
        description="Maintain the fork: pinned upstream SGLang + our patch series + our files.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sync = sub.add_parser(
        "sync", help="re-materialize upstream and re-apply the series"
    )
    sync.add_argument(
        "--force", action="store_true", help="discard unsaved edits to upstream files"
    )
    sub.add_parser(
        "status", help="which upstream files differ from pristine + series, and how"
    )
    save = sub.add_parser(
        "save", help="write edits made to upstream files back into the series"
    )
    mode = save.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--new", metavar="SUBJECT", help="add a new patch with this subject"
    )
    mode.add_argument(
        "--amend",
        metavar="PATCH",
        help="fold the edits into this patch (name or prefix)",
    )
    save.add_argument(
        "--body", help="commit message body: what the patch does and why (with --new)"
    )
    sub.add_parser(
        "check",
        help="exit 0 only if the series applies to pristine upstream and the tree matches",
    )
    export = sub.add_parser(
        "export", help="write an upstream-ready commit series (git am) to DIR"
    )
    export.add_argument("dir", type=Path)
    export.add_argument(
        "--test-each",
        action="store_true",
        help="then run the tests each commit brings on the tree at that commit "
        "(with this interpreter's pytest)",
    )
    rebase = sub.add_parser(
        "rebase", help="move the pin to VERSION with a 3-way apply of the series"
    )
    rebase.add_argument("version")
    rebase.add_argument(
        "--dry-run",
        action="store_true",
        help="only report per patch: clean, merged or CONFLICT (files, hunks); change nothing",
    )
    rebase.add_argument(
        "--wheel",
        type=Path,
        metavar="PATH",
        help="with --dry-run: VERSION's wheel file, instead of downloading it",
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    layout = Layout.find()
    try:
        if args.command == "sync":
            return commands.cmd_sync(layout, args.force)
        if args.command == "status":
            return commands.cmd_status(layout)
        if args.command == "save":
            return commands.cmd_save(layout, args.new, args.body, args.amend)
        if args.command == "check":
            return commands.cmd_check(layout)
        if args.command == "export":
            return commands.cmd_export(layout, args.dir.resolve(), args.test_each)
        return commands.cmd_rebase(
            layout,
            args.version,
            args.dry_run,
            args.wheel.resolve() if args.wheel else None,
        )
    except ForkError as e:
        print(f"tools/fork {args.command}: error: {e}", file=sys.stderr)
        return 1
