"""Engines that are wrong on chosen steps, for the tests of who the float64 reference finds wrong
(tests/test_wrong_baseline.py, tests/test_model_step_wrong_baseline.py)."""

from pkv.engines.reference import ReferenceEngine
from pkv.engines.sdpa import SdpaEngine


class CorruptsSteps:
    """An engine whose attention is wrong on the given steps, counted from the first step it plans
    (0 and 1 are the warmup steps): its first row is off by ``shift`` in every layer, as a kernel
    that read the wrong pages would be."""

    def __init__(self, *args, bad=(), shift=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad, self.shift = frozenset(bad), shift
        self.ordinal: dict[int, int] = {}

    def plan(self, step):
        self.ordinal.setdefault(int(step.step), len(self.ordinal))
        return super().plan(step)

    def run(self, q, k_pages, v_pages, plan):
        out = super().run(q, k_pages, v_pages, plan)
        if self.ordinal[int(plan.step.step)] in self.bad:
            out = out.clone()
            out[0] += self.shift
        return out


class WrongSdpa(CorruptsSteps, SdpaEngine):
    """A baseline (another library's kernel: not under study) that is wrong on some steps."""


class WrongReference(CorruptsSteps, ReferenceEngine):
    """PersistentKV's stand-in (under study) that is wrong on some steps."""
