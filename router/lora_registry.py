"""Which LoRA adapters the application serves, and on which base model: the static ones of the
config (EngineConfig.lora_modules) and those loaded at run time (POST /v1/load_lora_adapter).

Every ingress replica must agree, so run-time changes live in one named Ray actor per
application (LoRARegistry, created by the first ingress that asks); each ingress reads it
through an AdapterDirectory, a cached copy refreshed when older than REFRESH_S and at once on a
name it does not know (an adapter another ingress just loaded). An unload is seen at once by the
ingress that made it and by the others within REFRESH_S."""

from __future__ import annotations

import asyncio
import dataclasses
import time

REGISTRY_NAMESPACE = "stepserve"
# a cached copy older than this is refreshed before it answers (how late an unload made on
# another ingress replica takes effect here)
REFRESH_S = 1.0
# The registry is a named, detached actor on the head node (as the application's hub,
# replica/metrics.py HUB_ACTOR_OPTIONS): losing a worker node loses no adapter.
REGISTRY_ACTOR_OPTIONS = {
    "get_if_exists": True,
    "lifetime": "detached",
    "num_cpus": 0,
    "resources": {"node:__internal_head__": 0.001},
    "scheduling_strategy": "DEFAULT",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """A served adapter: clients put `name` in `model`; it runs on the base model `base`
    (a served model name) from the PEFT directory `path`, as the replicas' nodes see it."""

    name: str
    base: str
    path: str


class LoRARegistry:
    """The application's run-time adapter changes (the Ray actor's state): adapters loaded,
    and static adapters unloaded. Static adapters are not stored: each ingress knows them from
    its config, so a redeployed config's adapters are served without a stale copy here."""

    def __init__(self) -> None:
        self.loaded: dict[str, Adapter] = {}
        self.unloaded_static: set[str] = set()
        self.version = 0

    def add(self, adapter: Adapter) -> bool:
        """Record a loaded adapter; False when its name is taken by a loaded one."""
        if adapter.name in self.loaded:
            return False
        self.loaded[adapter.name] = adapter
        self.unloaded_static.discard(adapter.name)
        self.version += 1
        return True

    def remove(self, name: str, static: bool) -> bool:
        """Forget an adapter (`static`: one of the config's, unloaded until loaded again);
        False when there was none of that name."""
        if name in self.loaded:
            del self.loaded[name]
        elif static and name not in self.unloaded_static:
            self.unloaded_static.add(name)
        else:
            return False
        self.version += 1
        return True

    def snapshot(self) -> tuple[int, dict[str, Adapter], set[str]]:
        return self.version, dict(self.loaded), set(self.unloaded_static)


def registry_name(app_name: str) -> str:
    return f"stepserve-loras-{app_name}"


def get_registry(app_name: str):
    """The application's LoRARegistry actor, created by whoever asks first."""
    import ray

    return (
        ray.remote(LoRARegistry)
        .options(
            name=registry_name(app_name), namespace=REGISTRY_NAMESPACE, **REGISTRY_ACTOR_OPTIONS
        )
        .remote()
    )


def kill_registry(app_name: str) -> bool:
    """End the application's registry (its run-time adapters go with the application)."""
    import ray

    try:
        ray.kill(ray.get_actor(registry_name(app_name), namespace=REGISTRY_NAMESPACE))
    except ValueError:
        return False
    return True


async def _call(registry, method: str, *args):
    """A registry call: a Ray actor's (awaited) or a plain LoRARegistry's (tests, no Ray)."""
    fn = getattr(registry, method)
    remote = getattr(fn, "remote", None)
    return await remote(*args) if remote is not None else fn(*args)


class AdapterDirectory:
    """An ingress's view of the served adapters: the static ones (`static`, from the config),
    less those unloaded, plus those loaded at run time, as the registry last said."""

    def __init__(self, static: list[Adapter], registry=None) -> None:
        self.static = {a.name: a for a in static}
        self.registry = registry  # None: static adapters only (no Ray)
        self._loaded: dict[str, Adapter] = {}
        self._unloaded: set[str] = set()
        self._fetched = float("-inf")
        self._refreshing: asyncio.Future | None = None

    def _lookup(self, name: str) -> Adapter | None:
        if name in self._loaded:
            return self._loaded[name]
        return None if name in self._unloaded else self.static.get(name)

    async def refresh(self) -> None:
        """Read the registry (callers at the same time share one read)."""
        if self.registry is None:
            return
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(_call(self.registry, "snapshot"))
        pending = self._refreshing
        try:
            _, loaded, unloaded = await asyncio.shield(pending)
        finally:
            if self._refreshing is pending:
                self._refreshing = None
        self._loaded, self._unloaded = loaded, unloaded
        self._fetched = time.monotonic()

    async def _fresh(self) -> None:
        if time.monotonic() - self._fetched > REFRESH_S:
            await self.refresh()

    async def get(self, name: str) -> Adapter | None:
        """The adapter of this name, or None; a name not in the cached copy reads the registry
        again first (another ingress may have just loaded it)."""
        await self._fresh()
        adapter = self._lookup(name)
        if adapter is None and self.registry is not None:
            await self.refresh()
            adapter = self._lookup(name)
        return adapter

    async def all(self) -> list[Adapter]:
        await self._fresh()
        names = [*self.static, *(n for n in self._loaded if n not in self.static)]
        return [a for a in map(self._lookup, names) if a is not None]

    async def add(self, adapter: Adapter) -> bool:
        """Record a loaded adapter; False when the name is served already."""
        await self.refresh()
        if self._lookup(adapter.name) is not None:
            return False
        if self.registry is None:
            raise RuntimeError("adapters cannot be loaded at run time without the registry")
        if not await _call(self.registry, "add", adapter):
            return False
        self._loaded[adapter.name] = adapter
        self._unloaded.discard(adapter.name)
        return True

    async def remove(self, name: str) -> Adapter | None:
        """Forget the adapter of this name (seen at once here); the adapter, or None when no
        adapter has that name."""
        await self.refresh()
        adapter = self._lookup(name)
        if adapter is None or self.registry is None:
            return None
        if not await _call(self.registry, "remove", name, name in self.static):
            return None
        self._loaded.pop(name, None)
        if name in self.static:
            self._unloaded.add(name)
        return adapter
