"""A seeded synthetic agentic multi-turn trace (the shape of coding-agent sessions).

Each session starts from one of a few system prompts shared across sessions (tool definitions and
instructions) plus a first user message. Every turn the model replies and a tool runs; the next turn's
prompt is the whole context so far plus the reply and the tool output (sometimes a new user message
instead). Between turns the session "thinks": the reply is decoded elsewhere (1P1D) and the tool runs.

Two things make prefixes diverge, which is what separates restore policies:
* a new session shares only the system prompt with earlier sessions;
* with ``edit_prob`` a turn elides an earlier tool output from the context (agents trim long outputs),
  so the new prompt leaves the cached prefix in the middle of the history.

Same profile and seed, same trace, on any machine. Stdlib only (numpy draws tokens later, not here).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

from umbp.replay.trace import Segment, Turn


@dataclass(frozen=True)
class AgenticProfile:
    sessions: int = 280
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (6000, 14000)
    user_tokens: tuple[int, int] = (100, 1500)
    reply_tokens: tuple[int, int] = (50, 600)
    tool_tokens_median: int = 800
    tool_tokens_sigma: float = 1.0
    tool_tokens_max: int = 12000
    user_turn_prob: float = 0.15  # a turn adds a user message instead of a tool output
    edit_prob: float = 0.05  # a turn elides an earlier tool output (prefix diverges mid-history)
    turns: tuple[int, int] = (4, 30)
    think_s_mean: float = 15.0  # decode on the D instance + tool execution
    session_stagger_s: float = 0.5  # first turns arrive this far apart (no thundering herd at t=0)
    max_context: int = 100_000
    seed: int = 0

    def scaled(self, **changes) -> AgenticProfile:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


STUB_TOKENS = 24  # "[output elided]"


@dataclass
class _Session:
    name: str
    rng: random.Random
    context: list[Segment]
    tool_positions: list[int]  # indices into context of tool outputs that may still be elided
    pieces: int = 0

    def new_segment(self, kind: str, length: int) -> Segment:
        self.pieces += 1
        return Segment(id=f"{self.name}/{kind}{self.pieces}", length=max(1, length))


def generate(profile: AgenticProfile) -> list[Turn]:
    """All turns of all sessions, session by session (the replay interleaves them in time)."""
    rng = random.Random(profile.seed)
    systems = [
        Segment(id=f"sys{k}-seed{profile.seed}", length=rng.randint(*profile.system_tokens))
        for k in range(profile.system_prompts)
    ]
    turns: list[Turn] = []
    for i in range(profile.sessions):
        turns.extend(_session_turns(profile, i, systems, random.Random(rng.getrandbits(64))))
    return turns


def _session_turns(
    profile: AgenticProfile, index: int, systems: list[Segment], rng: random.Random
) -> Iterator[Turn]:
    s = _Session(f"s{index:05d}-seed{profile.seed}", rng, [], [])
    s.context = [rng.choice(systems), s.new_segment("u", rng.randint(*profile.user_tokens))]
    n_turns = rng.randint(*profile.turns)
    for t in range(n_turns):
        reply = rng.randint(*profile.reply_tokens)
        think = 0.0 if t == 0 else rng.expovariate(1.0 / profile.think_s_mean)
        arrival = index * profile.session_stagger_s if t == 0 else None
        yield Turn(s.name, t, tuple(s.context), output_tokens=reply, think_s=think, arrival_s=arrival)
        if not _advance(profile, s, reply):
            return


def _advance(profile: AgenticProfile, s: _Session, reply: int) -> bool:
    """Grow the context by this turn's reply and the next input; False when the session is full."""
    rng = s.rng
    if s.tool_positions and rng.random() < profile.edit_prob:
        pos = s.tool_positions.pop(rng.randrange(len(s.tool_positions)))
        s.context[pos] = s.new_segment("elided", STUB_TOKENS)
    s.context.append(s.new_segment("r", reply))
    if rng.random() < profile.user_turn_prob:
        s.context.append(s.new_segment("u", rng.randint(*profile.user_tokens)))
    else:
        s.tool_positions.append(len(s.context))
        s.context.append(s.new_segment("tool", _tool_tokens(profile, rng)))
    return sum(seg.size for seg in s.context) < profile.max_context


def _tool_tokens(profile: AgenticProfile, rng: random.Random) -> int:
    n = int(rng.lognormvariate(math.log(profile.tool_tokens_median), profile.tool_tokens_sigma))
    return max(8, min(n, profile.tool_tokens_max))
