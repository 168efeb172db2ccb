"""Module paths from before the layout by stage (issue 17), kept importable as aliases.

``import bridge.consumer`` gives the very module ``bridge.consume.reader`` (the same object, so
monkeypatching either name patches both). A module that was split (``bridge.checker``,
``bridge.sequencer``, ...) gives a module whose names are looked up in its parts, in order.
Nothing is imported until an old name is asked for. New code imports the new paths
(docs/architecture.md); the aliases stay for code written against earlier releases.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED: dict[str, str | tuple[str, ...]] = {
    "bridge.events": "bridge.vllm.events",
    "bridge.jsonview": "bridge.vllm.jsonview",
    "bridge.config": "bridge.ops.config",
    "bridge.metrics": "bridge.ops.metrics",
    "bridge.health": "bridge.ops.health",
    "bridge.logsetup": "bridge.ops.logsetup",
    "bridge.ratelimit": "bridge.ops.ratelimit",
    "bridge.sharding": "bridge.ops.sharding",
    "bridge.workers": "bridge.ops.workers",
    "bridge.localrun": "bridge.ops.localrun",
    "bridge.discovery.setup": "bridge.cli.discovery",
    "bridge.discovery.dns": "bridge.ops.discovery.dns",
    "bridge.discovery.k8swatch": "bridge.ops.discovery.k8swatch",
    "bridge.discovery.k8s": "bridge.ops.discovery.k8s",
    "bridge.discovery": "bridge.ops.discovery",
    "bridge.markers": "bridge.log.markers",
    "bridge.records": "bridge.log.records",
    "bridge.avro_encode": "bridge.log.avro",
    "bridge.split": "bridge.log.split",
    "bridge.registry": "bridge.log.registry",
    "bridge.sink": "bridge.log.sink",
    "bridge.partitioning": "bridge.log.partitioning",
    "bridge.checkpoints": "bridge.log.checkpoints",
    "bridge.sequencer": ("bridge.ingest.sequencer", "bridge.ingest.actions"),
    "bridge.subscriber": "bridge.ingest.subscriber",
    "bridge.listentopics": "bridge.ingest.listentopics",
    "bridge.listener": "bridge.ingest.listener",
    "bridge.pipeline": "bridge.ingest.pipeline",
    "bridge.replaylimit": "bridge.ingest.replaylimit",
    "bridge.runner": ("bridge.ingest.runner", "bridge.ingest.topics", "bridge.ingest.probes"),
    "bridge.consumer": "bridge.consume.reader",
    "bridge.statesync": "bridge.consume.statesync",
    "bridge.statetopic": ("bridge.consume.statetopic", "bridge.cli.state"),
    "bridge.stateserve": ("bridge.consume.stateserve", "bridge.cli.state"),
    "bridge.state": "bridge.consume.state",
    "bridge.checker": (
        "bridge.consume.checker",
        "bridge.consume.checkreport",
        "bridge.consume.sentlog",
        "bridge.cli.check",
    ),
    "bridge.contentkeys": "bridge.consume.contentkeys",
    "bridge.contentindex": "bridge.consume.contentindex",
    "bridge.score": "bridge.consume.score",
    "bridge.cliargs": "bridge.cli.args",
    "bridge.readcli": "bridge.cli.read",
    "bridge.configcheck": "bridge.cli.configcheck",
    "bridge.simulator.cli": "bridge.cli.simulate",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias's spec: give it back


class _Parts(importlib.abc.Loader):
    """A split module: its names are looked up in the modules it was split into."""

    def __init__(self, targets: tuple[str, ...]) -> None:
        self.targets = targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default: a new, empty module

    def exec_module(self, module: ModuleType) -> None:
        parts = [importlib.import_module(t) for t in self.targets]
        module.__doc__ = f"Moved: {module.__name__} is now {', '.join(self.targets)}."

        def __getattr__(name: str) -> object:  # PEP 562
            for part in parts:
                if hasattr(part, name):
                    return getattr(part, name)
            raise AttributeError(
                f"module {module.__name__!r} has no attribute {name!r} (it moved to "
                f"{', '.join(self.targets)}; see docs/architecture.md)"
            )

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):  # noqa: ANN201
        new = MOVED.get(fullname)
        if new is None:
            return None
        loader = _Alias(new) if isinstance(new, str) else _Parts(new)
        return importlib.machinery.ModuleSpec(fullname, loader)


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
