"""KDIA's teacher: triFreqs weights (kdia.md 1.3, paper Eq. 5-9), the store of every node's last
accepted model, and the teacher aggregation of Eq. 10 in an exact and three scalable forms.

Weights. For node k at round t, from the participation record (t_k: last accepted round, -1
before any; n_k: accepted participations; N_k: data size; only accepted updates count):

    F^intv_k = exp(-(t - t_k)) / sum_j exp(-(t - t_j))            (Eq. 5)
    F^part_k = n_k / sum_j n_j                                      (Eq. 7)
    F^num_k  = N_k / sum_j N_j                                      (Eq. 8)
    F_k      = (F^intv_k F^part_k F^num_k)^(1/3), normalised       (Eq. 9, the geometric mean)

The normalisers and exp(-t) cancel under the geometric mean, so ``F = softmax((t_k - t)/3 +
(log n_k + log N_k)/3)`` with -inf (weight exactly 0) for a node that never participated (spec
1.3 closed form, A10, A21). Everything is computed in log space in float64, vectorised over nodes,
so 10,000 rounds of staleness neither underflow nor divide by zero. The ablations of Table 3 (the
arithmetic mean and each factor alone) use the literal Eq. 5-9, also in log space.

Teacher modes (Eq. 10: ``theta_T = sum_k F_k theta_k`` over all nodes' stored models):
- `exact`: the reference; streams the stored models one at a time (memory or disk store).
- `windowed`: drops stored models older than `window_rounds` or whose share fell below
  `window_min_share`, renormalising over the kept ones; memory O(W K |theta|).
- `incremental`: exact up to rounding, O(K |theta|) work per round from running sums that read only
  the K replaced models (spec 6.3), re-synchronised from the store every `resync_every` rounds.
- `streaming`: the cohort EMA of spec 6.3, running sums updated from this round's updates only:
  O(|theta|) memory, no store at all, whatever the number of nodes.
Each approximate mode's error bound is in its docstring; `TeacherStep` reports the quantity that
bounds it every round.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch

from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.tensors import StateDict, cpu_copy

logger = logging.getLogger(__name__)

WEIGHTINGS = ("gm", "am", "intv", "part", "num")
TEACHER_MODES = ("exact", "windowed", "incremental", "streaming")
GM_DECAY = 1.0 / 3.0
"""Per-round log-decay of an idle node's geometric-mean weight: e^(-1/3) per round."""


# -- triFreqs weights --------------------------------------------------------------------------


def _log(x: np.ndarray) -> np.ndarray:
    """Natural log with log(0) = -inf and no warning."""
    x = np.asarray(x, dtype=np.float64)
    out = np.full(x.shape, -np.inf)
    np.log(x, out=out, where=x > 0)
    return out


def logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x)) if x.size else -math.inf
    if m == -math.inf:
        return -math.inf
    return m + math.log(float(np.sum(np.exp(x - m))))


def _normalise(log_w: np.ndarray) -> np.ndarray:
    total = logsumexp(log_w)
    return log_w - total if total > -math.inf else log_w


def log_factors(
    round: int, last_round: np.ndarray, count: np.ndarray, num_samples: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log F^intv, log F^part, log F^num of Eq. 5, 7, 8 (each normalised over the nodes given)."""
    log_intv = _normalise(-(round - np.asarray(last_round, dtype=np.float64)))
    return log_intv, _normalise(_log(count)), _normalise(_log(num_samples))


def log_teacher_weights(
    round: int,
    last_round: np.ndarray,
    count: np.ndarray,
    num_samples: np.ndarray,
    weighting: str = "gm",
    *,
    literal: bool = False,
) -> np.ndarray:
    """log F_k for every node, normalised (logsumexp 0; all -inf when no node has participated).

    `weighting` is ``gm`` (KDIA, Eq. 9), ``am`` (the arithmetic-mean ablation), or one factor alone
    (``intv``, ``part``, ``num``). The geometric mean uses the closed form unless `literal` (the
    two agree to rounding; a test checks it).
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    t_k = np.asarray(last_round, dtype=np.float64)
    if weighting == "gm" and not literal:
        # softmax((t_k - t)/3 + (log n_k + log N_k)/3): exp(-t) and the three normalisers cancel
        logits = GM_DECAY * ((t_k - round) + _log(count) + _log(num_samples))
        return _normalise(logits)
    log_intv, log_part, log_num = log_factors(round, last_round, count, num_samples)
    if weighting == "gm":
        return _normalise((log_intv + log_part + log_num) / 3.0)
    if weighting == "am":
        stacked = np.stack([log_intv, log_part, log_num])
        m = np.max(stacked, axis=0)
        finite = np.isfinite(m)
        am = np.full(m.shape, -np.inf)
        am[finite] = m[finite] + np.log(np.sum(np.exp(stacked[:, finite] - m[finite]), axis=0) / 3.0)
        return _normalise(am)
    return {"intv": log_intv, "part": log_part, "num": log_num}[weighting]


@dataclass(frozen=True, slots=True)
class TeacherWeights:
    """One round's teacher weights and the participation values they came from."""

    round: int
    node_ids: tuple[str, ...]
    last_round: np.ndarray
    count: np.ndarray
    num_samples: np.ndarray
    """Data sizes as used: the record's, or the mean of the known ones where the record has none."""
    log_weights: np.ndarray
    virtual: int = 0
    """Trailing entries standing for nodes the record has never seen (`num_nodes` padding)."""

    @property
    def weights(self) -> np.ndarray:
        return np.exp(self.log_weights)

    def index(self) -> dict[str, int]:
        return {node: i for i, node in enumerate(self.node_ids)}

    def log_gm_mass(self, i: int) -> float:
        """log of node i's unnormalised geometric-mean weight a_k at this round (spec 6.3)."""
        return GM_DECAY * (
            (float(self.last_round[i]) - self.round) + float(_log(self.count[i])) + float(_log(self.num_samples[i]))
        )

    def records(self, weighting: str) -> list[dict[str, Any]]:
        """One JSON-able record per known node: the weight and (t_k, n_k, N_k) behind it."""
        log_intv, log_part, log_num = log_factors(self.round, self.last_round, self.count, self.num_samples)
        out = []
        for i, node in enumerate(self.node_ids[: len(self.node_ids) - self.virtual]):
            out.append(
                {
                    "round": self.round,
                    "node_id": node,
                    "weight": float(math.exp(self.log_weights[i])),
                    "last_round": int(self.last_round[i]),
                    "count": int(self.count[i]),
                    "num_samples": int(self.num_samples[i]),
                    "f_intv": float(math.exp(log_intv[i])),
                    "f_part": float(math.exp(log_part[i])),
                    "f_num": float(math.exp(log_num[i])),
                    "weighting": weighting,
                }
            )
        return out


def weights_from_record(
    record: ParticipationRecord, round: int, weighting: str = "gm", *, num_nodes: int = 0
) -> TeacherWeights:
    """The teacher weights of every node in `record` at `round` (after this round's acceptances).

    Nodes the record has never seen do not exist for the weights, unless `num_nodes` exceeds the
    record's size: then that many more never-seen nodes are added (they matter only to the AM and
    single-factor ablations). A node without a known data size (never accepted) is given the mean
    of the known sizes; under the geometric mean neither matters, as such nodes weigh exactly 0.
    """
    arrays = record.arrays()
    ids = tuple(str(i) for i in arrays["node_ids"])
    last_round, count = arrays["last_round"], arrays["count"]
    sizes = arrays["num_samples"].astype(np.float64)
    known = sizes[sizes > 0]
    fill = float(known.mean()) if known.size else 1.0
    virtual = max(0, num_nodes - len(ids))
    if virtual:
        ids += tuple(f"(unseen {i})" for i in range(virtual))
        last_round = np.concatenate([last_round, np.full(virtual, -1, dtype=np.int64)])
        count = np.concatenate([count, np.zeros(virtual, dtype=np.int64)])
        sizes = np.concatenate([sizes, np.zeros(virtual)])
    sizes = np.where(sizes > 0, sizes, fill)
    log_w = log_teacher_weights(round, last_round, count, sizes, weighting)
    return TeacherWeights(round, ids, last_round, count, sizes, log_w, virtual)


# -- model stores ------------------------------------------------------------------------------


class ModelStore(ABC):
    """Every node's last accepted model (Eq. 10's theta_k), with the round it was accepted in."""

    @abstractmethod
    def put(self, node_id: str, round: int, state: Mapping[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def get(self, node_id: str) -> StateDict | None: ...

    @abstractmethod
    def discard(self, node_id: str) -> None: ...

    @abstractmethod
    def rounds(self) -> dict[str, int]:
        """Node id -> round of its stored model."""

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.rounds()

    def __len__(self) -> int:
        return len(self.rounds())

    def begin_round(self, last_committed: int) -> None:  # noqa: B027 (optional hook)
        """Called before a round's writes, when every round up to `last_committed` is checkpointed."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], last_committed: int) -> None:  # noqa: B027
        """Restore the store as of the checkpoint of round `last_committed`."""


class MemoryStore(ModelStore):
    """Models in memory (CPU), checkpointed with the coordinator's state."""

    def __init__(self) -> None:
        self._models: dict[str, tuple[int, StateDict]] = {}

    def put(self, node_id: str, round: int, state: Mapping[str, torch.Tensor]) -> None:
        self._models[node_id] = (round, cpu_copy(state))

    def get(self, node_id: str) -> StateDict | None:
        entry = self._models.get(node_id)
        return None if entry is None else entry[1]

    def discard(self, node_id: str) -> None:
        self._models.pop(node_id, None)

    def rounds(self) -> dict[str, int]:
        return {node: r for node, (r, _) in self._models.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for node, (r, state) in sorted(self._models.items()):
            out[f"{node}/@round"] = torch.tensor(r, dtype=torch.int64)
            out |= {f"{node}/{k}": v for k, v in state.items()}
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor], last_committed: int) -> None:
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            node, _, name = key.partition("/")
            grouped.setdefault(node, {})[name] = value
        self._models = {
            node: (int(group.pop("@round")), {k: v.clone() for k, v in group.items()})
            for node, group in grouped.items()
        }


def save_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write `tensors` as a safetensors file, atomically (a temporary file, then rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        safetensors.torch.save_file(contiguous, tmp, metadata=dict(metadata))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_safetensors(path: Path) -> tuple[StateDict, dict[str, str]]:
    """The tensors and the metadata of a safetensors file."""
    with safetensors.safe_open(path, framework="pt") as fh:
        metadata = dict(fh.metadata() or {})
        return {name: fh.get_tensor(name) for name in fh.keys()}, metadata  # noqa: SIM118 (safe_open has no __iter__)


class DiskStore(ModelStore):
    """One safetensors file per node in `directory` (``<node>.safetensors``, the round in its metadata).

    Memory holds only the index. Crash-safe against the coordinator's checkpoint: a file replaced
    in round t keeps its predecessor as ``<node>.prev.safetensors`` until round t is checkpointed,
    and `load_state_dict` (resume) rolls back any file newer than the checkpoint. A fresh run
    (nothing loaded) empties the directory at its first round.
    """

    SUFFIX = ".safetensors"
    PREV = ".prev.safetensors"

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._rounds: dict[str, int] = {}
        self._restored = False

    def _path(self, node_id: str, prev: bool = False) -> Path:
        return self.dir / f"{node_id}{self.PREV if prev else self.SUFFIX}"

    def _scan(self) -> Iterator[tuple[str, Path, bool]]:
        for path in sorted(self.dir.glob(f"*{self.SUFFIX}")):
            if path.name.endswith(self.PREV):
                yield path.name[: -len(self.PREV)], path, True
            else:
                yield path.name[: -len(self.SUFFIX)], path, False

    @staticmethod
    def _round_of(path: Path) -> int:
        with safetensors.safe_open(path, framework="pt") as fh:
            return int((fh.metadata() or {})["round"])

    def put(self, node_id: str, round: int, state: Mapping[str, torch.Tensor]) -> None:
        path = self._path(node_id)
        if path.exists() and not self._path(node_id, prev=True).exists():
            os.replace(path, self._path(node_id, prev=True))
        save_safetensors(path, state, {"round": str(round), "node_id": node_id})
        self._rounds[node_id] = round

    def get(self, node_id: str) -> StateDict | None:
        if node_id not in self._rounds:
            return None
        return load_safetensors(self._path(node_id))[0]

    def discard(self, node_id: str) -> None:
        self._path(node_id).unlink(missing_ok=True)
        self._rounds.pop(node_id, None)

    def rounds(self) -> dict[str, int]:
        return dict(self._rounds)

    def begin_round(self, last_committed: int) -> None:
        if not self._restored:
            self.load_state_dict({}, last_committed)
        for _, path, prev in list(self._scan()):
            if prev:
                path.unlink()

    def load_state_dict(self, state: Mapping[str, torch.Tensor], last_committed: int) -> None:
        self._restored = True
        self._rounds = {}
        entries = list(self._scan())
        for node, path, prev in entries:
            if prev:
                continue
            if self._round_of(path) <= last_committed:
                self._rounds[node] = self._round_of(path)
                continue
            older = self._path(node, prev=True)
            if older.exists() and self._round_of(older) <= last_committed:
                os.replace(older, path)
                self._rounds[node] = self._round_of(path)
            else:
                path.unlink()
        for _, path, prev in list(self._scan()):
            if prev:
                path.unlink()


# -- teacher aggregation ------------------------------------------------------------------------


class _Accumulator:
    """sum_k w_k theta_k in float64 for floating tensors; integer buffers (BatchNorm's
    num_batches_tracked) take the maximum over the contributing models (spec A16)."""

    def __init__(self, template: Mapping[str, torch.Tensor]) -> None:
        self.dtypes = {k: v.dtype for k, v in template.items()}
        self.sums = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in template.items() if v.is_floating_point()}
        self.ints: dict[str, torch.Tensor | None] = {k: None for k, v in template.items() if not v.is_floating_point()}
        self.total = 0.0

    def add(self, state: Mapping[str, torch.Tensor], weight: float) -> None:
        for k, acc in self.sums.items():
            acc.add_(state[k].to(torch.float64), alpha=weight)
        if weight > 0:
            for k, cur in self.ints.items():
                self.ints[k] = state[k].clone() if cur is None else torch.maximum(cur, state[k])
        self.total += weight

    def scale(self, factor: float) -> None:
        for acc in self.sums.values():
            acc.mul_(factor)
        self.total *= factor

    def mean(self, fallback: Mapping[str, torch.Tensor]) -> StateDict:
        out: StateDict = {k: (acc / self.total).to(self.dtypes[k]) for k, acc in self.sums.items()}
        for k, cur in self.ints.items():
            out[k] = (cur if cur is not None else fallback[k]).clone()
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"sum/{k}": v for k, v in self.sums.items()}
        out |= {f"int/{k}": v for k, v in self.ints.items() if v is not None}
        out["total"] = torch.tensor(self.total, dtype=torch.float64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for k in self.sums:
            self.sums[k] = state[f"sum/{k}"].to(torch.float64).clone()
        for k in self.ints:
            value = state.get(f"int/{k}")
            self.ints[k] = None if value is None else value.clone()
        self.total = float(state["total"])


@dataclass(frozen=True, slots=True)
class TeacherStep:
    """A round's teacher and the share of the exact teacher's weight it could not represent."""

    state: StateDict
    error_share: float
    """`windowed`: the exact weight share of dropped models; `streaming`: the share of stale cohort
    contributions; `exact`, `incremental`: 0. ``|theta - theta_exact|_inf <= error_share x range``,
    where range is the largest elementwise spread between any two models involved."""
    models_held: int


@dataclass(frozen=True, slots=True)
class Upload:
    """One accepted update as the teacher needs it."""

    node_id: str
    state: Mapping[str, torch.Tensor]
    previous_round: int
    """The node's last accepted round before this one (-1 if none)."""
    previous_count: int


class Teacher(ABC):
    """Builds theta_T each round from the weights, this round's uploads and what it keeps."""

    def __init__(self, initial: Mapping[str, torch.Tensor]) -> None:
        self.initial = cpu_copy(initial)
        """theta_g^0: the teacher before any round, and the stand-in model of never-seen nodes (A10)."""

    @abstractmethod
    def step(self, weights: TeacherWeights, uploads: Sequence[Upload]) -> TeacherStep: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        return None


class StoreTeacher(Teacher):
    """`exact` (Eq. 10 over every stored model) or `windowed` (over the recent ones only).

    Exact: overwrite the participants' stored models, then ``theta_T = sum_k F_k theta_k``, reading
    one stored model at a time; nodes with weight but no model yet (never participated, only under
    the AM or single-factor weightings) contribute theta_g^0 (spec A10).

    Windowed (`window_rounds` W > 0 and/or `min_share` > 0): after storing this round's models,
    discard every model older than W rounds or whose weight share is below `min_share` (never this
    round's), and average over the kept ones renormalised. Error bound: with delta the exact weight
    share of the discarded models (reported as `error_share`),
    ``|theta_win - theta_exact|_inf <= delta x max_ij |theta_i - theta_j|_inf``, because
    theta_win - theta_exact = delta (mean_kept - mean_dropped). Under the geometric mean a model
    older than W rounds has a_k <= e^(-(W+1)/3) c_k with c_k = (n_k N_k)^(1/3), so
    ``delta <= e^(-(W+1)/3) sum_dropped c_k / sum_{k in S_t} c_k``: about 4.5e-5 at W = 30 in the
    paper's setting (spec 6.3). Memory is O(W K |theta|) instead of O(N |theta|).
    """

    def __init__(
        self,
        initial: Mapping[str, torch.Tensor],
        store: ModelStore,
        *,
        window_rounds: int = 0,
        min_share: float = 0.0,
    ) -> None:
        super().__init__(initial)
        self.store = store
        self.window_rounds = window_rounds
        self.min_share = min_share

    def step(self, weights: TeacherWeights, uploads: Sequence[Upload]) -> TeacherStep:
        t = weights.round
        for up in uploads:  # Alg. 1 l.10: theta_k <- theta_k^{t+1} for k in S_t
            self.store.put(up.node_id, t, up.state)
        w = weights.weights
        held = self.store.rounds()
        current = {up.node_id for up in uploads}
        if self.window_rounds > 0 or self.min_share > 0:
            for i, node in enumerate(weights.node_ids):
                r = held.get(node)
                if r is None or node in current:
                    continue
                if (self.window_rounds > 0 and t - r > self.window_rounds) or w[i] < self.min_share:
                    self.store.discard(node)
            held = self.store.rounds()
        acc = _Accumulator(self.initial)
        dropped = 0.0
        default = 0.0
        for i, node in enumerate(weights.node_ids):
            if w[i] <= 0:
                continue
            if node in held:
                state = self.store.get(node)
                assert state is not None
                acc.add(state, float(w[i]))
            elif weights.count[i] == 0:
                default += float(w[i])
            else:
                dropped += float(w[i])
        if default > 0:
            acc.add(self.initial, default)
        if acc.total <= 0:
            return TeacherStep({k: v.clone() for k, v in self.initial.items()}, dropped, len(held))
        return TeacherStep(acc.mean(self.initial), dropped, len(held))


class StreamingTeacher(Teacher):
    """Running unnormalised sums ``A = sum_k a_k theta_k``, ``W = sum_k a_k`` with the
    geometric-mean masses ``a_k = e^((t_k - t)/3) c_k``, ``c_k = (n_k N_k)^(1/3)`` (spec 6.3);
    ``theta_T = A / W``. Idle nodes' masses all shrink by e^(-1/3) per round, so each round costs
    O(K |theta|). Requires the geometric-mean weighting.

    `incremental` (a store is given): ``A <- e^(-1/3) A - sum_{S_t} e^(-1/3) a_k^old theta_k^old +
    sum_{S_t} a_k^new theta_k^new``, reading only the K replaced models: exact up to float64
    rounding, re-computed from the store every `resync_every` rounds to bound the drift.

    `streaming` (no store): skip the subtraction, an EMA of cohort sums with O(|theta|) memory. Error
    bound: the re-participating nodes' earlier contributions stay in the sums with their decayed
    masses; with epsilon their share of W (tracked exactly, reported as `error_share`),
    theta_stream = (1 - epsilon) theta_exact + epsilon theta_stale, so
    ``|theta_stream - theta_exact|_inf <= epsilon x max_ij |theta_i - theta_j|_inf`` over every model
    ever uploaded. epsilon is of order e^(-Delta/3) for a mean re-participation gap Delta (about
    3.6% at Delta = 10, C = 0.1).
    """

    def __init__(
        self, initial: Mapping[str, torch.Tensor], store: ModelStore | None = None, *, resync_every: int = 0
    ) -> None:
        super().__init__(initial)
        self.store = store
        self.resync_every = resync_every
        self.acc = _Accumulator(self.initial)
        self.stale = 0.0
        self.last_round = -1
        self.steps = 0

    def step(self, weights: TeacherWeights, uploads: Sequence[Upload]) -> TeacherStep:
        t = weights.round
        index = weights.index()
        if self.last_round >= 0:
            decay = math.exp(-GM_DECAY * (t - self.last_round))
            self.acc.scale(decay)
            self.stale *= decay
        for up in uploads:
            i = index[up.node_id]
            if up.previous_round >= 0:
                size = float(weights.num_samples[i])
                log_old = GM_DECAY * ((up.previous_round - t) + math.log(up.previous_count) + math.log(size))
                if self.store is not None:
                    old = self.store.get(up.node_id)
                    if old is not None:  # the exact replacement: remove the old model's term
                        self.acc.add(old, -math.exp(log_old))
                else:
                    self.stale += math.exp(log_old)
            self.acc.add(up.state, math.exp(weights.log_gm_mass(i)))
            if self.store is not None:
                self.store.put(up.node_id, t, up.state)
        self.last_round = t
        self.steps += 1
        if self.store is not None and self.resync_every > 0 and self.steps % self.resync_every == 0:
            self._resync(weights)
        if self.acc.total <= 0:
            return TeacherStep({k: v.clone() for k, v in self.initial.items()}, 0.0, 0)
        held = len(self.store) if self.store is not None else 0
        share = self.stale / self.acc.total if self.store is None else 0.0
        return TeacherStep(self.acc.mean(self.initial), share, held)

    def _resync(self, weights: TeacherWeights) -> None:
        """Recompute A and W exactly from the store (bounds the drift of the incremental sums)."""
        assert self.store is not None
        acc = _Accumulator(self.initial)
        held = self.store.rounds()
        for i, node in enumerate(weights.node_ids):
            if node in held and weights.count[i] > 0:
                state = self.store.get(node)
                assert state is not None
                acc.add(state, math.exp(weights.log_gm_mass(i)))
        self.acc = acc

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"acc/{k}": v for k, v in self.acc.state_dict().items()}
        out["stale"] = torch.tensor(self.stale, dtype=torch.float64)
        out["last_round"] = torch.tensor(self.last_round, dtype=torch.int64)
        out["steps"] = torch.tensor(self.steps, dtype=torch.int64)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if not state:
            return
        self.acc.load_state_dict({k.removeprefix("acc/"): v for k, v in state.items() if k.startswith("acc/")})
        self.stale = float(state["stale"])
        self.last_round = int(state["last_round"])
        self.steps = int(state["steps"])


def make_teacher(
    mode: str,
    initial: Mapping[str, torch.Tensor],
    store: ModelStore | None,
    *,
    window_rounds: int = 0,
    min_share: float = 0.0,
    resync_every: int = 0,
) -> Teacher:
    if mode not in TEACHER_MODES:
        raise ValueError(f"teacher mode must be one of {TEACHER_MODES}, got {mode!r}")
    if mode == "streaming":
        return StreamingTeacher(initial)
    if store is None:
        raise ValueError(f"teacher mode {mode!r} needs a model store")
    if mode == "incremental":
        return StreamingTeacher(initial, store, resync_every=resync_every)
    if mode == "windowed":
        return StoreTeacher(initial, store, window_rounds=window_rounds, min_share=min_share)
    return StoreTeacher(initial, store)


def uploads_from_record(
    record: ParticipationRecord, round: int, states: Sequence[tuple[str, Mapping[str, torch.Tensor]]]
) -> list[Upload]:
    """This round's uploads with each node's previous (t_k, n_k), recovered from the record, which
    already holds this round's acceptances (its last interval is the gap to the previous one).

    In async mode ``round`` is the model version index and one node may appear several times
    (several updates folded into one version): it gets one upload, its last state in `states` (the
    model the store keeps for it), in the position of its first appearance, and its previous
    (t_k, n_k) are those before all of this round's acceptances. Every acceptance the record holds
    for `round` is assumed to be among `states`, as the engine records exactly the folded updates.
    """
    repeats: dict[str, int] = {}
    last: dict[str, Mapping[str, torch.Tensor]] = {}
    for node_id, state in states:
        repeats[node_id] = repeats.get(node_id, 0) + 1
        last[node_id] = state
    out = []
    for node_id, times in repeats.items():
        entry = record.get(node_id)
        if entry is None or entry.last_round != round or entry.count < times:
            raise ValueError(f"node {node_id} has no accepted participation in round {round} in the record")
        previous_count = entry.count - times
        # a repeat in `round` appended no interval, so the last one is still the gap to the node's previous round
        previous = round - entry.intervals[-1] if previous_count > 0 and entry.intervals else -1
        out.append(Upload(node_id, last[node_id], previous, previous_count))
    return out
