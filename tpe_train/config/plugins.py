"""Position encodings from the user's own packages, found through the ``tpe_train.positions`` entry points.

A package registers an encoding in its ``pyproject.toml``::

    [project.entry-points."tpe_train.positions"]
    scaled = "mypkg.positions:ScaledSinusoidal"

and, once installed, ``model.position.kind=scaled`` works as a built-in name does: in ``tpe-train``, the
Slurm position sweep, ``tpe-study`` and export (which refuses, naming the reason, where an encoding has
no exported form; see ``PositionEncoding.export_note``).

The entry points are read once, at the registry's first lookup (``Registry.load_with``), not when
``tpe_train`` is imported. A plugin that cannot be used (its import fails, its name is a built-in's or
another plugin's, its object is not a ``PositionEncoding`` subclass, its name is not a plain word) does
not stop anything else: one warning lists every such plugin when they are read, and asking for one of
them (``model.position.kind=<name>``) is an error naming its package, its entry point and the fix.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from tpe_train.positions import POSITIONS, PositionEncoding
from tpe_train.positions.registry import Registry

GROUP = "tpe_train.positions"
NAME = re.compile(r"[A-Za-z0-9_]+")  # a run directory and a study setting (<kind>-noenc) carry it

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plugin:
    """Where an encoding of the user's own package comes from."""

    name: str
    value: str  # module:Class
    package: str  # the installed distribution that declares it

    def where(self) -> str:
        return f"entry point {self.name} = {self.value} of package {self.package} (group {GROUP})"


#: the plugins added to the registry, by name
LOADED: dict[str, Plugin] = {}


def _plugin(ep: EntryPoint) -> Plugin:
    dist = getattr(ep, "dist", None)
    return Plugin(ep.name, ep.value, dist.name if dist is not None else "<unknown package>")


def _why_unusable(ep: EntryPoint, plugin: Plugin, registry: Registry[type[PositionEncoding]]) -> str | None:
    """Why this entry point cannot be added (None: it can); imports its module."""
    if not NAME.fullmatch(ep.name):
        return "its name is not made of letters, digits and _ only; rename the entry point"
    if ep.name in registry:
        owner = LOADED.get(ep.name)
        first = f"the plugin of package {owner.package}" if owner else "a built-in encoding"
        return f"its name is already {first}'s; rename the entry point"
    try:
        obj = ep.load()
    except Exception as err:  # any error of the user's module: report it, do not stop the others
        return f"importing it failed ({type(err).__name__}: {err}); fix the package or uninstall it"
    if not (isinstance(obj, type) and issubclass(obj, PositionEncoding)):
        return (
            f"it names {obj!r}, not a subclass of tpe_train.positions.PositionEncoding; point the entry "
            "point at the encoding's class"
        )
    registry.register(ep.name)(obj)
    LOADED[ep.name] = plugin
    return None


def load_positions(registry: Registry[type[PositionEncoding]]) -> None:
    """Add every installed ``tpe_train.positions`` entry point to ``registry`` (sorted by name); warn
    once about those that cannot be used, and record why, for a lookup of that name to report."""
    broken = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: (e.name, e.value)):
        plugin = _plugin(ep)
        why = _why_unusable(ep, plugin, registry)
        if why is not None:
            message = f"the position encoding of {plugin.where()} is not usable: {why}"
            registry.mark_broken(ep.name, message)
            broken.append(message)
    if broken:
        logger.warning("position-encoding plugins skipped:\n  %s", "\n  ".join(broken))


def plugin_of(kind: str) -> Plugin | None:
    """The plugin that provides ``kind`` (None: a built-in or unknown)."""
    POSITIONS.names()  # the entry points are read
    return LOADED.get(kind)


def export_refusal(kind: str, form: str, forms: str) -> str | None:
    """Why the encoding ``kind`` has no ``form`` export (CTranslate2, transformers), whose position forms
    are ``forms``: its class's ``export_note``, else (an encoding of the user's own package) that its
    hooks are its package's own code; None for a built-in without a note (the exporter decides)."""
    plugin = plugin_of(kind)
    cls = POSITIONS.get(kind) if kind in POSITIONS else None
    note = cls.export_note if cls is not None else None
    if plugin is None and note is None:
        return None
    origin = f"the position encoding {kind!r}" + (f" ({plugin.where()})" if plugin else "")
    why = note or (
        f"{form} computes positions only in its own forms ({forms}), and this encoding's hooks are its "
        "package's own Python code, which an exported model does not carry"
    )
    return f"{origin} has no {form} form: {why}. Export it with --format native (tpe-eval, tpe-translate)"


POSITIONS.load_with(load_positions)
