"""Register the MiTA-DeiT and ViT-5 models with timm as soon as timm is imported, without importing it.

``import mita`` must stay fast and work without timm, yet ``timm.create_model`` must know
the ``mita_deit_*``, ``vit5_*`` and ``mita_vit5_*`` names. If timm is loaded already the names are registered at once;
otherwise a one-shot import hook registers them right after ``import timm`` finishes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

#: the modules whose import registers models with timm
MODEL_MODULES = ("mita.models.deit", "mita.models.vit5")


def _register() -> None:
    for name in MODEL_MODULES:
        if name in sys.modules:  # imported, or being imported now: it registers when it finishes
            continue
        try:
            importlib.import_module(name)  # registers the models on import
        except Exception as err:  # a broken timm must not break ``import timm`` or ``import mita``
            warnings.warn(f"mita could not register its timm models ({name}): {err}", stacklevel=2)


class _AfterTimmImport(importlib.abc.MetaPathFinder):
    """Finds ``timm`` with the normal finders, then runs :func:`_register` after it executes."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "timm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("timm")
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_and_register(module: ModuleType) -> None:
            run(module)
            _register()

        spec.loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Register now if timm is loaded, else when it is first imported (nothing if it is absent)."""
    if sys.modules.get("timm") is not None:
        _register()
    elif importlib.util.find_spec("timm") is not None and not any(
        isinstance(f, _AfterTimmImport) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterTimmImport())
