"""The adaptive engine: the calibrated route policy over PersistentKV and the FlashInfer role."""

from __future__ import annotations

from dataclasses import dataclass

from pkv.engines.base import Engine
from pkv.policy.route import ROUTE_FLASHINFER


@dataclass
class AdaptivePlan:
    """A PersistentKV route decision and the persistent engine's own plan.

    ``route``, ``num_splits``, ``schedule`` and ``step`` read like any EnginePlan, so the
    harness counts routes and counters the same way for every engine. Steps routed to
    FlashInfer get FlashInfer's plan itself (route "flashinfer"), with no wrapper around it.
    """

    route: str
    decision: object
    inner: object
    step: object

    @property
    def schedule(self):
        return getattr(self.inner, "schedule", None)

    @property
    def kernel_variant(self):
        return getattr(self.inner, "kernel_variant", None)

    @property
    def merge(self):
        return self.decision.route.merge

    @property
    def num_splits(self):
        return int(self.decision.route.num_splits)

    @property
    def split_rule(self):
        return self.decision.route.split_rule


class AdaptiveEngine(Engine):
    """Asks the route policy per step, then plans and runs the route it chose."""

    held_to_paper_bound = True

    def __init__(self, policy, persistent: Engine, fallback: Engine) -> None:
        if not hasattr(persistent, "plan_route"):
            raise ValueError(
                f"AdaptiveEngine needs a persistent engine with plan_route(step, route), "
                f"got {persistent!r}")
        self.policy = policy
        self.persistent = persistent
        self.fallback = fallback
        self.name = "adaptive"
        self.implementation = f"adaptive({persistent.implementation}|{fallback.implementation})"

    def plan(self, step):
        decision = self.policy.choose(step)
        if decision.route.name == ROUTE_FLASHINFER:
            # The fallback's plan as it is: on a step that ends on FlashInfer, everything the
            # adaptive engine adds to FlashInfer's own host time is the route check. Wrapping the
            # plan cost about 0.35 us a step on the development CPU, several times that on the
            # GPU machine's host, where these steps take about 230 us of wall time.
            return self.fallback.plan(step)
        inner = self.persistent.plan_route(step, decision.route)
        return AdaptivePlan(route=decision.route.name, decision=decision, inner=inner, step=step)

    def prepare(self, step, q, k_pages, v_pages) -> None:
        # Either engine may be chosen for this step; both get their one-off work untimed: the
        # fallback its variant probe, the persistent engine a first run of the route and split
        # count the policy picks (warm_up runs each kernel set once per process).
        self.fallback.prepare(step, q, k_pages, v_pages)
        route = self.policy.choose(step).route
        if route.name != ROUTE_FLASHINFER:
            self.persistent.warm_up(self.persistent.plan_route(step, route), q, k_pages, v_pages)

    def path_record(self) -> dict | None:
        """The fallback's FlashInfer path record, where the fallback is FlashInfer."""
        return self.fallback.path_record()

    def run(self, q, k_pages, v_pages, plan):
        if plan.route == ROUTE_FLASHINFER:
            return self.fallback.run(q, k_pages, v_pages, plan)
        return self.persistent.run(q, k_pages, v_pages, plan.inner)
