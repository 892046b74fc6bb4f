"""The algorithm half's heavy calls as the engine's commands ask for them: one definition for the
daemon (which runs them on its worker thread) and the in-process driver (which runs them inline),
so that both call the half the same way."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedmq.coordinator.compressed import check_one_model, restore
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.storage.versions import ModelVersions
from fedmq.fedcore import masked as m
from fedmq.fedcore.aggregation import weighted_average
from fedmq.fedcore.algorithms.base import (
    CoordinatorHalf,
    NodeUpdate,
    Payload,
    half_state,
    load_half_state,
    mean_reported_loss,
)
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.privacy import NodePrivacy, default_delta
from fedmq.fedcore.secagg import SecAggError, dequantise, sum_mod, unmask
from fedmq.fedcore.tensors import StateDict, TensorSpec, model_sha256, non_finite

Records = Mapping[str, Sequence[Mapping[str, Any]]]
"""The half's `round_records`, by log name."""


SECURE_SUM = "secure-sum"
"""The node id of the one update a secure aggregation hands the half: the survivors' mean."""


def update_schema(half: CoordinatorHalf, config: CoordinatorConfig) -> dict[str, dict[str, TensorSpec]]:
    """What the engine checks updates against: the half's schema, or with secure aggregation the
    masked vector (`fedcore.masked`)."""
    if config.secure_aggregation is not None:
        return m.masked_schema(half.model.state_dict())
    return {g: dict(specs) for g, specs in half.update_schema().items()}


class HalfCalls:
    def __init__(self, half: CoordinatorHalf, config: CoordinatorConfig, *, masks: bool = True) -> None:
        self.half = half
        self.masks = masks
        """False in a replay: the recomputed updates are not masked (the nodes' masks are random and
        never logged), so their sum is taken as it is; the unmasking is exact, so the model is the same."""
        self.versions = ModelVersions()
        """The models tasks carried, kept and let go as the engine's commands say (`Configure.keep_model`,
        `Aggregate.keep_from`): the engine decides which an update may still need, nothing here does."""
        self._deltas = config.compression.enabled and config.compression.delta
        """Delta-compressed updates are differences from their task's model: added back before aggregating."""
        self.node_privacy = node_privacy(config)
        """What node DP-SGD has spent, reported with each aggregation (None without it)."""
        self._last_good: tuple[StateDict, StateDict] | None = None
        """The model and the half's state from before the last aggregation, to fall back on when its
        model is rejected: copied into the same buffers each time (one pass over the model, no
        allocation), so that asynchronous folding, at thousands of updates a second, keeps one too."""

    def configure(self, command: c.Configure) -> Payload | Mapping[str, Payload]:
        payload = self.half.configure_round(command.ctx)
        if self._deltas and not isinstance(payload, Payload):
            check_one_model(payload)
        if command.keep_model:
            self.versions.keep(command.ctx.version, payload, self.half)
        return payload

    def aggregate(self, command: c.Aggregate) -> tuple[e.Aggregated, Records]:
        """The new model, and the metrics the round logs (the averaging rule's, then the half's)."""
        updates = restore(command.updates, self.versions.model) if self._deltas else command.updates
        ctx = self.versions.context(command)
        begin = getattr(self.half.average, "begin_round", None)  # a rule that needs the round (central DP's noise)
        if begin is not None:
            begin(ctx)
        secure_metrics: dict[str, float] = {}
        if command.secure is not None:
            try:
                updates, secure_metrics = self._unmask(command)
            except SecAggError as exc:  # never a wrong model: the attempt ends without one
                why = f"secure aggregation: {exc}"
                return e.Aggregated(command.step, {}, model_sha256(self.half.model), rejected=why), {}
        self._snapshot()
        calls = getattr(self.half.average, "calls", None)
        if command.secure is not None and command.secure.settings.l2_clip is not None:
            metrics = self._with_plain_mean(lambda: self.half.aggregate(ctx, updates, command.failures))
        else:
            metrics = self.half.aggregate(ctx, updates, command.failures)
            if calls is not None and updates and self.half.average.calls == calls:  # type: ignore[attr-defined]
                raise AlgorithmError(
                    f"{type(self.half).__module__} aggregated without its averaging rule, so"
                    f" {type(self.half.average).__name__} (privacy.mechanism) never saw the updates: this method"
                    " cannot run with it"
                )
        bad = non_finite(dict(self.half.model.state_dict()))
        if bad is not None:  # never published: the round's updates overflowed the average
            self.rollback()
            return e.Aggregated(command.step, {}, model_sha256(self.half.model), rejected=f"non-finite ({bad})"), {}
        metrics = {**self.half.averaging_metrics(), **secure_metrics, **metrics}
        if self.node_privacy is not None:
            metrics |= self.node_privacy.metrics(ctx.participation)
        records = self.half.round_records()
        self.versions.prune(command.keep_from)
        return e.Aggregated(command.step, metrics, model_sha256(self.half.model)), records

    def _with_plain_mean(self, call: Callable[[], Mapping[str, float]]) -> Mapping[str, float]:
        """`call` with the half averaging by the plain weighted mean: with secure aggregation, central
        DP's noise is on the one update already (`_release`), which the rule would clip and noise again."""
        rule = self.half.average
        self.half.average = weighted_average
        try:
            return call()
        finally:
            self.half.average = rule

    def _unmask(self, command: c.Aggregate) -> tuple[list[NodeUpdate], dict[str, float]]:
        """The survivors' masked updates as the one update they sum to (the weighted mean model), and
        what the unmasking reports. The half never sees a node's own update."""
        secure = command.secure
        assert secure is not None
        masked = {u.node_id: m.from_wire(u.payload.tensors[m.GROUP][m.TENSOR]) for u in command.updates}
        if self.masks:
            result = unmask(
                secure.settings,
                secure.key,
                masked=masked,
                graph=secure.graph,
                shared=secure.shared,
                public_keys=secure.public_keys,
                commitments=secure.commitments,
                b_shares=secure.seed_shares,
                s_shares=secure.key_shares,
            )
            total, bad = result.total, len(result.bad_shares)
        else:
            total, bad = dequantise(sum_mod(masked.values()), secure.settings), 0
        counts = [u.num_samples for u in command.updates]
        dp = secure.settings.l2_clip is not None  # central DP: the sum is sum_k clip(d_k) / K already
        weights = 1.0 if dp else sum(counts) / secure.weight_total
        base = self.half.model.state_dict()
        model = self._release(m.as_change(base, total)) if dp else m.mean_model(base, total, weights)
        loss = mean_reported_loss(command.updates, [float(n) for n in counts])
        clipped = sum(int(u.payload.meta.get("secagg_clipped", 0) or 0) for u in command.updates)
        first = command.updates[0]
        update = NodeUpdate(
            node_id=SECURE_SUM,
            round=first.round,
            num_samples=sum(counts),
            payload=Payload(tensors={"model": model}, meta={} if loss != loss else {"loss": loss}),
            base_version=first.base_version,
        )
        metrics = {
            "secagg_survivors": float(len(masked)),
            "secagg_dropped": float(len(secure.shared) - len(masked)),
            "secagg_clipped": float(clipped),
            "secagg_error_bound": secure.settings.error_bound(len(masked)) / weights,
            "secagg_bad_shares": float(bad),
        }
        return [update], metrics

    def _release(self, change: StateDict) -> StateDict:
        """Central DP's noise on the unmasked sum of clipped changes (the rule's `release`), the next model."""
        release = getattr(self.half.average, "release", None)
        if release is None:
            raise AlgorithmError(
                "secure aggregation with l2_clip is central DP's, and the averaging rule cannot release a sum"
            )
        released: StateDict = release(change)
        return released

    def _snapshot(self) -> None:
        model, state = self._last_good or (None, None)
        self._last_good = _copy_into(model, self.half.model.state_dict()), _copy_into(state, half_state(self.half))

    def rollback(self) -> None:
        """Back to the model (and the half's state) from before the last aggregation: the engine
        rejected what it made (`c.Rollback`), so the next round starts from the last good model."""
        if self._last_good is None:
            raise RuntimeError("no aggregation to roll back")
        model, state = self._last_good
        self.half.model.load_state_dict(model)
        load_half_state(self.half, state)


def _copy_into(kept: StateDict | None, current: Mapping[str, Any]) -> StateDict:
    """`current`'s tensors copied into `kept`'s when they match it (names, shapes, dtypes), else fresh
    copies: a method's state may change form between rounds (a teacher appears), its model does not."""
    if kept is None or kept.keys() != current.keys():
        return {k: v.detach().clone() for k, v in current.items()}
    if any(kept[k].shape != v.shape or kept[k].dtype != v.dtype for k, v in current.items()):
        return {k: v.detach().clone() for k, v in current.items()}
    for name, tensor in current.items():
        kept[name].copy_(tensor.detach())
    return kept


def node_privacy(config: CoordinatorConfig) -> NodePrivacy | None:
    """The node DP-SGD accounting `config`'s training asks for: its delta, or a tenth of 1 / the nodes."""
    if config.train.dp_noise_multiplier is None:
        return None
    delta = config.node_dp_delta if config.node_dp_delta is not None else default_delta(len(config.nodes or ()))
    return NodePrivacy(config.train, delta)
