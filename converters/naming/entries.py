"""The entries of a name mapping: what happens to one source tensor (`Mapped`), and a tensor the
converter computes instead of copying (`Derived`)."""

from __future__ import annotations

from dataclasses import dataclass

from hpckpt.core.dtypes import DType


@dataclass(frozen=True)
class Mapped:
    """What happens to one source tensor.

    `destination` None: not written under any name (dropped, or only feeds `Derived` entries;
    `note` says which). `rule` names the rule(s) that decided it, None when none did.
    """

    source: str
    destination: str | None
    transpose: tuple[int, ...] | None = None
    dtype: DType | None = None
    rule: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class Derived:
    """A destination tensor with no one-to-one source, computed by the converter.

    Kinds: "step" (a step count: the value of the one source counter, or of the per-parameter
    steps, which must agree), "lr" (the learning rate; a 1-D MindSpore schedule is indexed at
    the step), "beta1_power"/"beta2_power" (beta**step with the betas of the sources' param
    groups), "num_batches_tracked" (0: MindSpore does not count BatchNorm batches; torch reads
    it only when momentum is None).
    """

    destination: str
    sources: tuple[str, ...]
    kind: str
    dtype: DType
    shape: tuple[int, ...]
    rule: str
