"""A griffe extension for the API reference: seqpar's docstrings name things with Sphinx roles
(:func:`seqpar.plan`, :class:`~.seam.Objective`); Markdown has no roles, so each becomes a code
span of the name it points at (a leading ``~`` or ``.`` dropped, as Sphinx shows it)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|mod|class|data|meth|attr|exc|obj):`~?\.?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"``\1``", obj.docstring.value)
