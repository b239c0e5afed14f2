"""How a fleet's client picks the replica for each request (``deltaserve bench --router``; the
front of ``deltaserve serve --replicas``): one base class, a registry by name and a factory
(:func:`create_router`).

A router sees only what a load balancer in front of serving replicas sees: the request's place
in the trace, the requests it sent each replica that have not finished (*in flight*), and which
replicas are down. A replica whose engine failed is marked down (:meth:`Router.mark_down`) and
gets no more requests: the others take its share, so a failed replica costs the requests it
held, not the fleet's service. Every policy routes only among live replicas; with all of them
down there is nowhere to send (:class:`NoLiveReplica`).

The client's threads and the replicas' callbacks call a router concurrently; one lock keeps a
choice and the in-flight count it is made on together.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from deltaserve.core.errors import InputError, require


class NoLiveReplica(RuntimeError):
    """Every replica is down: a request has nowhere to go."""


class Router(ABC):
    """The in-flight counts and the live replicas; a subclass says which live one gets a
    request (:meth:`_pick`)."""

    name: ClassVar[str]
    summary: ClassVar[str]

    def __init__(self, num_replicas: int):
        require(isinstance(num_replicas, int) and num_replicas >= 1, "replicas", num_replicas,
                "must be an integer >= 1")
        self.num_replicas = num_replicas
        self._in_flight = [0] * num_replicas
        self._down: set[int] = set()
        self._lock = threading.Lock()

    def route(self, index: int) -> int:
        """The replica request ``index`` of the trace goes to; it counts as in flight there
        until :meth:`finished`. Raises :class:`NoLiveReplica` when every replica is down."""
        with self._lock:
            live = [r for r in range(self.num_replicas) if r not in self._down]
            if not live:
                raise NoLiveReplica(f"all {self.num_replicas} replicas are down")
            replica = self._pick(index, live)
            self._in_flight[replica] += 1
            return replica

    def finished(self, replica: int) -> None:
        """A request sent to ``replica`` finished (called once per request)."""
        with self._lock:
            if self._in_flight[replica] <= 0:
                raise RuntimeError(f"replica {replica}: a request finished that was never "
                                   f"routed there")
            self._in_flight[replica] -= 1

    def mark_down(self, replica: int) -> None:
        """``replica`` serves no more: route around it from now on."""
        with self._lock:
            self._down.add(replica)

    def is_live(self, replica: int) -> bool:
        with self._lock:
            return replica not in self._down

    @property
    def any_live(self) -> bool:
        with self._lock:
            return len(self._down) < self.num_replicas

    @property
    def in_flight(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._in_flight)

    @abstractmethod
    def _pick(self, index: int, live: Sequence[int]) -> int:
        """One of ``live`` (ascending, never empty) for request ``index``; called under the
        lock, with :attr:`_in_flight` current."""


class RoundRobin(Router):
    """Request ``index`` goes to the ``index mod L``-th of the ``L`` live replicas: ``index mod
    N`` while every replica is up (equal shares of every stretch of the trace, whatever its
    lengths), the live ones' equal shares after one fails."""

    name = "round-robin"
    summary = "request i to live replica i mod N (the default)"

    def _pick(self, index: int, live: Sequence[int]) -> int:
        return live[index % len(live)]


class LeastLoaded(Router):
    """The live replica with the fewest requests in flight; among equals, the first at or
    after ``index mod N`` in cyclic order (so ties rotate as round-robin does, and an idle
    fleet is routed round-robin)."""

    name = "least-loaded"
    summary = "the live replica with the fewest requests in flight (ties rotate)"

    def _pick(self, index: int, live: Sequence[int]) -> int:
        n, start = self.num_replicas, index % self.num_replicas
        return min(live, key=lambda r: (self._in_flight[r], (r - start) % n))


ROUTERS: dict[str, type[Router]] = {cls.name: cls for cls in (RoundRobin, LeastLoaded)}
DEFAULT_ROUTER = RoundRobin.name


def check_router(name: str) -> None:
    """An input error naming ``router`` unless ``name`` is a registered router."""
    if name not in ROUTERS:
        raise InputError("router", name, f"choose from {', '.join(ROUTERS)}")


def create_router(name: str, num_replicas: int) -> Router:
    """The router called ``name`` over ``num_replicas`` replicas."""
    check_router(name)
    return ROUTERS[name](num_replicas)
