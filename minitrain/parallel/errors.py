"""A technique's refusal of a parameter's value, as data: which parameter, which value.

The techniques name their parameters as a caller of the function writes them (``chunks=1``); the
harness words the same refusal in its own terms (the CLI's ``--chunks 1``) from these fields, never
from the message's text.
"""

from __future__ import annotations

__all__ = ["ParameterError"]


class ParameterError(ValueError):
    """A parameter's value that a technique cannot run with.

    ``parameter`` and ``value``: the refused one (default: the first mention).  The message is
    ``text`` with a ``{}`` wherever a parameter is mentioned; ``mentions`` are the ``(name, value)``
    pairs that fill them, in order: the refused one, what it was checked against, the fix
    suggested.  ``str()`` words each as the technique's caller writes it, ``name=value`` (the
    refused value, when a string, as its ``repr``: ``schedule='dualpipe'``; a suggestion as it is:
    ``schedule=1f1b``); :meth:`worded` words them another way.  Without mentions ``text`` is the
    whole message.
    """

    def __init__(self, text: str, *mentions: tuple[str, object], parameter: str | None = None,
                 value=None):
        if mentions and text.count("{}") != len(mentions):
            raise TypeError(f"{text.count('{}')} places for {len(mentions)} mentions in {text!r}")
        super().__init__(text, *mentions)
        self.text, self.mentions = text, mentions
        if parameter is None and mentions:
            parameter, value = mentions[0]
        self.parameter, self.value = parameter, value

    def worded(self, word=lambda name, shown: f"{name}={shown}") -> str:
        """The message with each mention as ``word(name, its value as shown)``."""
        if not self.mentions:
            return self.text
        refused = (self.parameter, self.value)
        words = [word(name, repr(v) if isinstance(v, str) and (name, v) == refused else str(v))
                 for name, v in self.mentions]
        pieces = self.text.split("{}")
        return "".join(p + w for p, w in zip(pieces, words + [""]))

    def __str__(self) -> str:
        return self.worded()
