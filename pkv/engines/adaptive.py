"""The adaptive engine: the calibrated route policy over PersistentKV and the FlashInfer role."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkv.engines.base import Engine
from pkv.policy.choose import RouteDecision, RoutePolicy
from pkv.policy.native import NativeRoutePolicy
from pkv.policy.route import ROUTE_FLASHINFER


@dataclass
class AdaptivePlan:
    """A PersistentKV route decision and the persistent engine's own plan.

    ``route``, ``num_splits``, ``schedule`` and ``step`` read like any EnginePlan, so the
    harness counts routes and counters the same way for every engine. Steps routed to
    FlashInfer get FlashInfer's plan itself (route "flashinfer"), with no wrapper around it.
    A step decided in C++ keeps the choice as C++ returned it, and builds its RouteDecision
    when something reads it (off the per-step path).
    """

    step_route: object  # the StepRoute planned
    _decision: object  # a RouteDecision, or (native policy, choice ints, estimates)
    inner: object
    step: object

    @property
    def route(self) -> str:
        return self.step_route.name

    @property
    def decision(self):
        if not isinstance(self._decision, RouteDecision):
            native, choice, estimates = self._decision
            self._decision = native.decision(choice, estimates)
        return self._decision

    @property
    def schedule(self):
        return getattr(self.inner, "schedule", None)

    @property
    def kernel_variant(self):
        return getattr(self.inner, "kernel_variant", None)

    @property
    def merge(self):
        return self.step_route.merge

    @property
    def num_splits(self):
        return int(self.step_route.num_splits)

    @property
    def split_rule(self):
        return self.step_route.split_rule


class OneOpPlan:
    """An eager adaptive step whose route is decided, planned and launched by one op call
    (PersistentKVEngine.step_chosen), made by its first run. That run leaves the step's plan here:
    an AdaptivePlan, or FlashInfer's own plan where the policy picks FlashInfer, planned then. A
    later run of it replays that plan without deciding again, so a second run times the kernels
    alone, as for any plan. Reading the plan before it has run plans it then (decided and
    uploaded, not launched), and the run launches that plan."""

    def __init__(self, engine: "AdaptiveEngine", step) -> None:
        self.step = step
        self._engine = engine
        self._plan = None
        self._chosen = None  # the one call's (choice, estimates, packed plan), until something reads it

    def resolved(self):
        """The step's plan: an AdaptivePlan, or FlashInfer's."""
        if self._plan is None:
            engine = self._engine
            if self._chosen is None:
                self._plan = engine._plan_chosen(self.step)
            else:
                choice, estimates, packed = self._chosen
                route = engine._native.route(choice)
                self._plan = engine._native_plan(self.step, route, choice, estimates,
                                                 engine.persistent.device_plan_of(self.step, route, packed))
        return self._plan

    def __getattr__(self, name):  # route, num_splits, decision, schedule, ... of the step's plan
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolved(), name)


class AdaptiveEngine(Engine):
    """Asks the route policy per step, then plans and runs the route it chose.

    With a calibrated RoutePolicy and a persistent engine that plans in C++ (``plan_chosen``), the
    policy's C++ form decides and plans each step in one call (pkv.policy.native); otherwise the
    Python policy decides and the persistent engine plans the route. With ``one_op_step`` as well
    (an eager persistent engine on a GPU), plan() defers the step to its run, which decides, plans
    and launches it in one op call (OneOpPlan).
    """

    held_to_paper_bound = True

    def __init__(self, policy, persistent: Engine, fallback: Engine, *, native_policy: bool = True,
                 one_op_step: bool = False) -> None:
        if not hasattr(persistent, "plan_route"):
            raise ValueError(
                f"AdaptiveEngine needs a persistent engine with plan_route(step, route), "
                f"got {persistent!r}")
        self.policy = policy
        self.persistent = persistent
        self.fallback = fallback
        self.name = "adaptive"
        self._native = None
        # native_policy=False keeps the Python policy on every step: the comparison host_bench times.
        if (native_policy and isinstance(policy, RoutePolicy) and hasattr(persistent, "plan_chosen")
                and getattr(persistent, "planner", None) == "native"):
            self._native = NativeRoutePolicy(policy, persistent.ops)
        self.one_op_step = bool(one_op_step)
        if self.one_op_step and (self._native is None or getattr(persistent, "cuda_graph", True)
                                 or torch.device(persistent.device).type != "cuda"):
            raise ValueError("AdaptiveEngine: one_op_step needs the native route policy (a calibrated RoutePolicy, "
                             "the native planner) and an eager persistent engine on a CUDA device; its "
                             f"persistent engine is {persistent.implementation} on "
                             f"{getattr(persistent, 'device', 'an unknown device')}")
        self.implementation = f"adaptive({persistent.implementation}|{fallback.implementation})" + (
            "+one_op" if self.one_op_step else "")

    def plan(self, step):
        if self._native is not None:
            # A gated step goes to FlashInfer without the C++ call, whose step tensors and checks
            # would cost it more than the Python gates do.
            if self.policy.gate(step) is not None:
                return self.fallback.plan(step)
            return OneOpPlan(self, step) if self.one_op_step else self._plan_chosen(step)
        decision = self.policy.choose(step)
        if decision.route.name == ROUTE_FLASHINFER:
            # The fallback's plan as it is: on a step that ends on FlashInfer, everything the
            # adaptive engine adds to FlashInfer's own host time is the route check. Wrapping the
            # plan cost about 0.35 us a step on the development CPU, several times that on the
            # GPU machine's host, where these steps take about 230 us of wall time.
            return self.fallback.plan(step)
        inner = self.persistent.plan_route(step, decision.route)
        return AdaptivePlan(step_route=decision.route, _decision=decision, inner=inner, step=step)

    def _plan_chosen(self, step):
        """A step past the gates, decided and planned in one C++ call and not launched: an
        AdaptivePlan, or FlashInfer's plan where the estimate leaves the step to it."""
        route, choice, estimates, inner = self.persistent.plan_chosen(step, self._native)
        if inner is None:
            return self.fallback.plan(step)
        return self._native_plan(step, route, choice, estimates, inner)

    def _native_plan(self, step, route, choice, estimates, inner) -> AdaptivePlan:
        """The AdaptivePlan of a C++ decision; its RouteDecision is built when something reads it."""
        return AdaptivePlan(step_route=route, _decision=(self._native, choice, estimates), inner=inner, step=step)

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
        if isinstance(plan, OneOpPlan):
            if plan._plan is None and plan._chosen is None:
                # The first run: one call decides, plans, uploads and launches. Its plan objects are
                # built when something reads them (a later run, the harness's records).
                choice, estimates, packed, out = self.persistent.step_chosen(plan.step, self._native, q, k_pages,
                                                                             v_pages)
                if packed is not None:
                    plan._chosen = (choice, estimates, packed)
                    return out
                plan._plan = self.fallback.plan(plan.step)
            plan = plan.resolved()
        if not isinstance(plan, AdaptivePlan):  # a FlashInfer step runs the fallback's own plan
            return self.fallback.run(q, k_pages, v_pages, plan)
        return self.persistent.run(q, k_pages, v_pages, plan.inner)
