"""A griffe extension for the API reference: the docstrings' Sphinx roles as inline code.

The docstrings cite other objects Sphinx's way (``:func:`~keras_dpsgd.accounting.compute_epsilon```); Markdown
would show the role as it is written. Each role becomes the name in code (the last part where the target starts
with ``~``, as Sphinx shows it). Loaded by ``mkdocs.yml`` (plugins, mkdocstrings, ``extensions``); no import of the
package, as the rest of the reference.
"""

import re

import griffe

_ROLE = re.compile(r":(?:attr|class|data|func|meth|mod|obj|exc):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    short, target = match[1], match[2]
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites ``:role:`target``` in every docstring as ```target```."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
