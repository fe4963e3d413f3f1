"""The set of hosted models, and how requests name one."""

from __future__ import annotations

from ..core import errors
from .host import ModelHost


class ModelSet:
    """Hosted models by id. ``get("")`` is the only model when exactly one is hosted."""

    def __init__(self) -> None:
        self.hosts: dict[str, ModelHost] = {}

    def add(self, host: ModelHost) -> None:
        if host.model_id in self.hosts:
            raise ValueError(f"model id {host.model_id!r} is hosted twice")
        self.hosts[host.model_id] = host

    def get(self, model_id: str, field: str = "model_id") -> ModelHost:
        if not model_id:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            raise errors.invalid(
                f"{field} is empty but {len(self.hosts)} models are hosted ({', '.join(sorted(self.hosts))}); "
                "name one",
                field=field,
            )
        host = self.hosts.get(model_id)
        if host is None:
            raise errors.not_found(
                f"{field}: model {model_id!r} is not hosted here (hosted: {', '.join(sorted(self.hosts)) or 'none'})",
                field=field,
                model_id=model_id,
            )
        return host

    def select(self, model_id: str) -> list[ModelHost]:
        """The named model, or every hosted model when ``model_id`` is empty."""
        return [self.get(model_id)] if model_id else list(self.hosts.values())

    def owner_of(self, cache_id: str) -> str | None:
        """The model whose registry holds (or held) ``cache_id``."""
        for mid, host in self.hosts.items():
            reg = host.executor.registry
            if cache_id in reg or reg.was_released(cache_id):
                return mid
        return None

    def __iter__(self):
        return iter(self.hosts.values())

    def __len__(self) -> int:
        return len(self.hosts)
