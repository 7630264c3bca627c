"""`umbp explain`: why did a hybrid restore stop at T? (backed by umbp.hybrid.explain)

    umbp explain --groups full:400,state:400 --unit 16 --max-tokens 839 \\
                 --present 0=400,800,832 --present 1=832

Groups: `full:B` (full attention), `swa:B:W` (sliding window W), `state:B` (Mamba/GDN/KDA recurrent state).
`--present G=t1,t2,...` lists the token ends at which group G has a stored object. With `--dcp N`, block
sizes are per rank (as in vLLM's specs) and attention blocks span B x N tokens:

    umbp explain --groups full:128,state:128 --unit 128 --dcp 8 --max-tokens 9999 --present 0=1024 --present 1=1152

Token counts (--max-tokens, --hashed-tokens, --present ends, block sizes, windows, block spans under DCP)
are at most 2**24, and the blocks the explanation walks (--max-tokens, and each sliding window, over each
group's block size, plus --max-tokens over the unit) at most 2**22 in all.
"""

from __future__ import annotations

import argparse
import sys

from umbp.tools.argtypes import whole

MAX_TOKENS = 1 << 24
MAX_BLOCKS = 1 << 22  # blocks walked in all: time and memory are linear in them (2**22: ~2 s, ~0.4 GB)
MAX_DCP = 1 << 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", required=True, help="comma list: full:B, swa:B:W, state:B")
    parser.add_argument(
        "--unit", type=whole(1, MAX_TOKENS), required=True, help="prefix_match_unit (hash block size)"
    )
    parser.add_argument(
        "--max-tokens", type=whole(0, MAX_TOKENS), required=True, help="most tokens that may be restored"
    )
    parser.add_argument(
        "--present",
        action="append",
        default=[],
        metavar="G=t1,t2",
        help="token ends stored for group G (repeatable)",
    )
    parser.add_argument(
        "--hashed-tokens", type=whole(0, MAX_TOKENS), default=None, help="where the request's keys end"
    )
    parser.add_argument("--eagle", action="store_true", help="EAGLE block drop on every group")
    parser.add_argument("--eagle-groups", default="", help="comma list of groups that take EAGLE's drop")
    parser.add_argument(
        "--dcp", type=whole(1, MAX_DCP), default=1, help="decode_context_parallel_size (block sizes per rank)"
    )


def parse_groups(text: str) -> list:
    from umbp.hybrid import FullAttention, RecurrentState, SlidingWindow

    groups = []
    for item in text.split(","):
        kind, *nums = item.strip().split(":")
        try:
            values = [int(n) for n in nums]
            if not all(1 <= v <= MAX_TOKENS for v in values):
                raise ValueError
            if kind in ("full", "fa") and len(values) == 1:
                groups.append(FullAttention(block_size=values[0]))
            elif kind in ("swa", "sliding") and len(values) == 2:
                groups.append(SlidingWindow(block_size=values[0], window=values[1]))
            elif kind in ("state", "mamba") and len(values) == 1:
                groups.append(RecurrentState(block_size=values[0]))
            else:
                raise ValueError
        except ValueError:
            raise SystemExit(
                f"umbp explain: bad group {item!r}; use full:B, swa:B:W or state:B (B and W from 1 to "
                f"{MAX_TOKENS})"
            ) from None
    return groups


def parse_present(items: list[str], num_groups: int) -> list[set[int]]:
    present: list[set[int]] = [set() for _ in range(num_groups)]
    for item in items:
        group, _, ends = item.partition("=")
        try:
            g = int(group)
            if not 0 <= g < num_groups:
                raise IndexError
            values = {int(t) for t in ends.split(",") if t.strip()}
            if not all(0 < t <= MAX_TOKENS for t in values):
                raise ValueError
            present[g].update(values)
        except (ValueError, IndexError):
            raise SystemExit(
                f"umbp explain: bad --present {item!r}; use G=t1,t2 with 0 <= G < {num_groups} and token "
                f"ends from 1 to {MAX_TOKENS}"
            ) from None
    return present


def parse_eagle_groups(text: str, num_groups: int) -> set[int] | None:
    try:
        out = {int(g) for g in text.split(",") if g.strip()}
    except ValueError:
        out = {-1}
    if not all(0 <= g < num_groups for g in out):
        raise SystemExit(
            f"umbp explain: bad --eagle-groups {text!r}; use a comma list of group numbers from 0 to "
            f"{num_groups - 1}"
        )
    return out or None


def check_sizes(args: argparse.Namespace, groups: list) -> None:
    """One clear error for sizes past what an explanation can walk in moments (it is linear in them;
    each option alone is bounded by its parser type)."""
    span = max(g.block_size for g in groups) * args.dcp
    if span > MAX_TOKENS:
        raise SystemExit(
            f"umbp explain: a block spans {span} tokens under --dcp {args.dcp}; at most {MAX_TOKENS}"
        )
    blocks = args.max_tokens // args.unit + sum(
        (args.max_tokens + getattr(g, "window", 0)) // g.block_size for g in groups
    )
    if blocks > MAX_BLOCKS:
        raise SystemExit(
            f"umbp explain: --max-tokens {args.max_tokens} (and the sliding windows) over the groups' block "
            f"sizes and the unit is {blocks} blocks to walk; at most {MAX_BLOCKS}: lower --max-tokens"
        )


def run(args: argparse.Namespace) -> int:
    from umbp.hybrid import explain

    groups = parse_groups(args.groups)
    check_sizes(args, groups)
    present = parse_present(args.present, len(groups))
    eagle_groups = parse_eagle_groups(args.eagle_groups, len(groups))
    try:
        text = explain(
            groups,
            args.unit,
            present,
            args.max_tokens,
            eagle=args.eagle,
            eagle_groups=eagle_groups,
            hashed_tokens=args.hashed_tokens,
            dcp_world_size=args.dcp,
        )
    except ValueError as exc:
        raise SystemExit(f"umbp explain: {exc}") from None
    print(text)
    sys.stdout.flush()
    return 0
