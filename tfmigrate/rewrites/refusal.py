"""The one exception every rewrite raises when it declines: the message says why (and, where
it can, on which line), and `fix` prints it as the finding's "no automatic fix" reason.

Families subclass it where their callers act on the kind of refusal (a tf2 step that falls
back to the compat target, per-tower feeds that stay per replica, a queue pipeline kept as
it is), so that one `except Refused` catches every refusal that reaches a rule.
"""

from __future__ import annotations

import re

__all__ = ["Refused", "StateRefused"]

# A line break in quoted code (a call continued with `\` or over several lines), with the
# indentation after it: the reason is printed on one line.
_BREAK = re.compile(r"\s*\\?\n\s*")


class Refused(Exception):
    """The code does not have a shape this rewrite handles; the message says why, on one line."""

    def __init__(self, message: str = "", *args):
        super().__init__(_BREAK.sub(" ", message) if isinstance(message, str) else message, *args)


class StateRefused(Refused):
    """A refusal about what training needs (regularization made by the first tower only, a
    global step the update cannot count), not about the loop's shape: no other rewrite may take it."""
