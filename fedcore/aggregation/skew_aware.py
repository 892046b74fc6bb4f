"""Skew-aware aggregation (SA): FedSA's averaging rule, for any method whose server averages models.

Wang, Liao, Yuan and Zhang, "The Key of Parameter Skew in Federated Learning", arXiv 2024,
https://arxiv.org/abs/2408.11278 (v1; v2 renames the method FedPake). The paper names no code, and
none was found (``lokinko/FedSA`` is a different method). SA changes only the server's averaging,
never the nodes' training, so it is a rule like the weighted mean: the FedSA method
(`fedcore.algorithms.fedsa`) is FedAvg with SA as its average, and ``method.aggregator`` "fedsa"
gives SA to any method whose server averages client models (FedProx, MOON, FedAvgM's average before
its momentum step).

For every floating tensor j ("layer", flattened to M values) of the K client models W (K x M):

    mu   = mean_k W[k]                      s = (W - mu)^2                       (Eqs. 2, 3)
    cv   = sqrt(mean_k s) / (|mu| + eps)                                         (Eq. 4)
    h    = (cv - min cv) / (max cv - min cv) > cv_t ; low part: mu               (Eqs. 5-7)
    MIC  = clamp(ceil(C_mic * s[:, h] / max s[:, h]), 1, C_mic)  (K x M_h bins)  (Eqs. 8, 9)
    SIM(a, b) = share of the M_h positions where MIC[a] = MIC[b]                 (Eq. 10)
    clusters  = greedy average-linkage clustering of SIM, at most S_mac          (text after Eq. 10)
    MAC_s = per-position mode of the members' MIC (ties: smaller bin)            (Eq. 11)
    wbar_s = mean of the members' W[:, h]                                        (Eq. 12)
    alpha_s[m] = n_{s, MAC_s[m]} / sum_s' n_{s', MAC_s'[m]},  n_{s,c} = #{m: MAC_s[m] = c}  (Eq. 14, normalised)
    out[h] = sum_s alpha_s * wbar_s ;  out[~h] = mu                              (Eqs. 13, 15)

Everything runs per tensor as torch ops over all its positions at once. The statistics over the M
positions (mean, variance, CV, mask) stream over the K updates as `weighted_average` does, with
M-sized buffers; only the M_h high-dispersion positions are stacked (K x M_h). The similarity is
C_mic one-hot GEMMs (K x M_h x K) counting agreements exactly; only the greedy clustering, on the
K x K matrix, is sequential in K. The rule is deterministic for a given order of the updates (they
arrive sorted by node id); exact ties in the clustering go to the lower index, so only there can a
permutation of the updates change the result.

Where the paper is silent or garbled (fedsa.md section 5), each choice is an option defaulting to
the spec's recommendation:
- #2 CV near mu = 0: cv = std / (|mu| + `eps`) with plain min-max (faithful); `cv_clip_quantile`
  < 1 clips cv at that quantile first (0.99: the spec's robust variant). The share of
  high-dispersion parameters is reported every round (metric ``sa_high_share``, and per tensor in
  the FedSA method's ``fedsa_layers`` log) so that the effect can be measured.
- #3 `weighted`: false (the paper's unweighted "client-dimension average") for mu, the CV and the
  cluster means; true uses the sample counts, as FedAvg does.
- #4 N of Eq. 8 is undefined: `bins` "uniform" (N = C_mic on s normalised by its maximum over the
  layer's high-dispersion entries) or "quantile" (bin edges at the j / C_mic quantiles of those s).
- #5 `signed`: false follows the paper (squared deviation, the sign is lost); true doubles the
  categories, bins 1..C for clients at or below the mean and C+1..2C above.
- #6 Eq. 14 is unnormalised as printed: `weighting` "count" (the spec's normalised reading above),
  "size" (alpha_s proportional to the cluster's size, or its sample mass when `weighted`) or
  "inverse_bin" (alpha_s[m] proportional to 1 / MAC_s[m], the magnitude bin when `signed`).
- #7 clustering details: `greedy_cluster` documents its rules (average linkage, joining an existing
  cluster wins ties, clusters never merge, `sim_t` only after the S_mac cap with memberships frozen,
  lowest index on ties).
- #8 clients left unclustered are excluded from that tensor's high-dispersion positions only; they
  still count in mu (the low part and the CV).
- #10 buffers: non-trainable tensors (buffers, and parameters with requires_grad false: SA applies to
  "all trainable tensors", #1) take the plain mean (`buffers` "mean") or, as PFLlib's
  ``aggregate_parameters`` leaves them, the first update's copy (`buffers` "first"; updates arrive
  sorted by node id). Which entries are buffers is known only from the model (`SkewAwareAggregator.bind`):
  unbound, every floating entry goes through SA. Integer tensors (``num_batches_tracked``) take the
  maximum, as `weighted_average` does ("first": the first update's).
- #11 degenerate cases (K < 2, a one-element tensor, max cv = min cv, no high-dispersion position)
  give the plain mean, bit for bit the `weighted_average` of the same weights (the mean is
  accumulated in the same order and precision). So ``cv_t = 1`` (nothing is ever above it) is the
  neutral setting: FedAvg with `weighted` true, the unweighted mean with it false.
- #16 the statistics use the updates of the round only (K = the accepted updates).
The paper's settings (App. B): cv_t = sim_t = 0.2; (C_mic, S_mac) = (4, 4) CIFAR-10, (5, 5)
CIFAR-100, (8, 8) Tiny-ImageNet. The defaults are CIFAR-10's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedmq.fedcore.tensors import StateDict

WEIGHTINGS = ("count", "size", "inverse_bin")
BINS = ("uniform", "quantile")
BUFFERS = ("mean", "first")
_EXACT_FLOAT32 = 2**24
"""Counts below this are exact in float32 (the agreement GEMMs switch to float64 above it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SkewAwareOptions:
    cv_t: float = 0.2
    """Threshold on the min-max normalised coefficient of variation, in [0, 1]: above it a parameter
    is high-dispersion (paper, App. B: 0.2; 1 makes every parameter low: the plain mean)."""
    sim_t: float = 0.2
    """After the S_mac cap, a client joins its most similar cluster only if the similarity is above
    this, in [0, 1] (paper, App. B: 0.2)."""
    c_mic: int = 4
    """Number of Micro-Class bins C, 1 to 127 (paper: 4 CIFAR-10, 5 CIFAR-100, 8 Tiny-ImageNet)."""
    s_mac: int = 4
    """Maximum number of Macro-Classes (clusters) S, at least 1 (paper: 4 CIFAR-10, 5 CIFAR-100, 8 Tiny-ImageNet)."""
    eps: float = 1e-12
    """Added to |mean| in the CV's denominator, positive (spec 1.2: 1e-12)."""
    cv_clip_quantile: float = 1.0
    """Clip the CV at this quantile before min-max, in (0, 1]: 1 is the paper's plain min-max, 0.99
    the spec's robust variant (fedsa.md 5 #2)."""
    weighting: str = "count"
    """Eq. 14, normalised over clusters per position: "count" (n_{s, MAC_s[m]}, the spec's reading),
    "size" (cluster size) or "inverse_bin" (1 / MAC_s[m]) (fedsa.md 5 #6)."""
    bins: str = "uniform"
    """Micro-Class bins: "uniform" (equal widths on s / max s, the spec's reading of Eq. 8) or
    "quantile" (equal counts) (fedsa.md 5 #4)."""
    signed: bool = False
    """Bin the signed deviation (2 C categories) instead of the squared one (paper: false; 5 #5)."""
    weighted: bool = False
    """Weight the mean, the CV and the cluster means by sample counts (paper: false, the
    unweighted client mean; true: FedAvg's weights) (fedsa.md 5 #3)."""
    buffers: str = "mean"
    """Non-trainable entries: "mean" (the spec's recommendation) or "first" (the first update's,
    as PFLlib leaves BatchNorm statistics) (fedsa.md 5 #10)."""

    def __post_init__(self) -> None:
        for name in ("cv_t", "sim_t"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not 1 <= self.c_mic <= 127:
            raise ValueError(f"c_mic must be an integer from 1 to 127, got {self.c_mic!r}")
        if self.s_mac < 1:
            raise ValueError(f"s_mac must be a positive integer, got {self.s_mac!r}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a positive number, got {self.eps!r}")
        if not (math.isfinite(self.cv_clip_quantile) and 0.0 < self.cv_clip_quantile <= 1.0):
            raise ValueError(f"cv_clip_quantile must be in (0, 1], got {self.cv_clip_quantile!r}")
        for name, allowed in (("weighting", WEIGHTINGS), ("bins", BINS), ("buffers", BUFFERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class LayerStats:
    """What SA did with one tensor in one round (the diagnostics of spec 6.4)."""

    name: str
    size: int
    high: int
    """High-dispersion positions M_h (0: the tensor took the plain mean)."""
    clusters: tuple[tuple[int, ...], ...] = ()
    """Members of each Macro-Class, as indices into the round's updates."""
    unclustered: tuple[int, ...] = ()


# -- the steps of SA, each on one tensor's K client copies --------------------------------------


def client_mean(rows: Sequence[torch.Tensor], p: Sequence[float]) -> torch.Tensor:
    """mu = sum_k p_k W[k] (Eq. 2), accumulated row by row in the order given, exactly as
    `weighted_average` does, so that the low-dispersion part is bit for bit its mean."""
    acc = torch.zeros_like(rows[0])
    for row, weight in zip(rows, p, strict=True):
        acc.add_(row, alpha=weight)
    return acc


def client_variance(rows: Sequence[torch.Tensor], mu: torch.Tensor, p: Sequence[float]) -> torch.Tensor:
    """sum_k p_k s[k] with s[k] = (W[k] - mu)^2 (Eqs. 3, 4), row by row: one M-sized buffer, never
    the K x M matrix of squared deviations."""
    var = torch.zeros_like(mu)
    dev = torch.empty_like(mu)
    for row, weight in zip(rows, p, strict=True):
        torch.sub(row, mu, out=dev)
        var.addcmul_(dev, dev, value=weight)
    return var


def coefficient_of_variation(var: torch.Tensor, mu: torch.Tensor, eps: float) -> torch.Tensor:
    """cv = sqrt(var) / (|mu| + eps), per position (Eq. 4)."""
    return var.sqrt().div_(mu.abs().add_(eps))


def high_dispersion(cv: torch.Tensor, cv_t: float, clip_quantile: float = 1.0) -> torch.Tensor:
    """r^h = 1[(cv - min cv) / (max cv - min cv) > cv_t] (Eqs. 5, 6), all false when max = min.

    With `clip_quantile` < 1 the maximum is the CV's `clip_quantile` quantile (the k-th smallest, k =
    ceil(q M)) and larger values count as 1 (the robust variant of fedsa.md 5 #2)."""
    lo = cv.min()
    if clip_quantile < 1.0:
        k = min(cv.numel(), max(1, math.ceil(clip_quantile * cv.numel())))
        hi = cv.kthvalue(k).values
    else:
        hi = cv.max()
    if not bool(hi > lo):
        return torch.zeros_like(cv, dtype=torch.bool)
    return (cv.clamp(max=hi) - lo).div_(hi - lo) > cv_t


def micro_classes(
    s_h: torch.Tensor, c_mic: int, bins: str = "uniform", above: torch.Tensor | None = None
) -> torch.Tensor:
    """The MIC map (Eqs. 8, 9), K x M_h bins in 1..C_mic of the squared deviations `s_h` at the
    high-dispersion positions (uint8).

    "uniform": clamp(ceil(C_mic s / max s), 1, C_mic) (N = C_mic; an exact zero goes to bin 1);
    "quantile": bin c holds the s in (q_{c-1}, q_c], q_c the c / C_mic quantile of all K M_h values.
    With `above` (the signed variant: deviation > 0) bins C+1..2C are those above the mean.
    """
    if bins == "uniform":
        top = s_h.max()
        scaled = s_h / top if bool(top > 0) else torch.zeros_like(s_h)
        mic = scaled.mul_(c_mic).ceil_().clamp_(1, c_mic)
    elif bins == "quantile":
        flat = s_h.reshape(-1)
        ks = [max(1, math.ceil(c * flat.numel() / c_mic)) for c in range(1, c_mic)]
        edges = torch.stack([flat.kthvalue(k).values for k in ks]) if ks else flat.new_empty(0)
        mic = torch.bucketize(s_h, edges).add_(1)
    else:
        raise ValueError(f"bins must be one of {', '.join(BINS)}, got {bins!r}")
    mic = mic.to(torch.uint8)
    if above is not None:
        mic += above.to(torch.uint8) * c_mic
    return mic


def agreement_counts(mic: torch.Tensor, codes: int) -> torch.Tensor:
    """A[a, b] = #{m: MIC[a, m] = MIC[b, m]} = sum_c E_c E_c^T with E_c = 1[MIC = c] (Eq. 10's
    numerator): `codes` GEMMs, exact (integer counts), as a float64 K x K matrix on the CPU.
    SIM = A / M_h."""
    k, m_h = mic.shape
    dtype = torch.float32 if m_h < _EXACT_FLOAT32 else torch.float64
    out = torch.zeros(k, k, dtype=dtype, device=mic.device)
    for c in range(1, codes + 1):
        e = (mic == c).to(dtype)
        out.addmm_(e, e.T)
    return out.to("cpu", torch.float64)


def greedy_cluster(
    sim: torch.Tensor | np.ndarray, max_clusters: int, threshold: float
) -> tuple[list[list[int]], list[int]]:
    """Macro-Classes from a K x K similarity matrix (text after Eq. 10; fedsa.md 1.8 and 5 #7).

    The similarity of client a to cluster c is the mean of SIM[a, b] over its members b (average
    linkage). While clients are free and fewer than `max_clusters` clusters exist: take the best
    (client, cluster) join and the most similar free pair; join if the join's similarity is at least
    the pair's (ties favour joining), else the pair opens a new cluster; a lone free client with no
    cluster yet opens one alone. Clusters never merge. Once the cap is reached, each remaining
    client, against the clusters as they were at that moment, joins its most similar cluster if that
    similarity is above `threshold`, else it is unclustered. Ties go to the lowest index (client
    first, then cluster; pairs by (a, b)). SIM may be in any unit (the aggregator passes exact
    agreement counts and threshold sim_t M_h, so that equal similarities compare equal).

    Returns (clusters as sorted member lists in order of creation, unclustered clients sorted).
    """
    a = np.asarray(sim, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"similarity must be a square matrix, got shape {a.shape}")
    if max_clusters < 1:
        raise ValueError(f"max_clusters must be at least 1, got {max_clusters}")
    k = a.shape[0]
    free = np.ones(k, dtype=bool)
    members: list[list[int]] = []
    sums = np.zeros((0, k))  # row c: sum over c's members b of SIM[b, :]
    while free.any() and len(members) < max_clusters:
        idx = np.flatnonzero(free)
        pair: tuple[int, int, float] | None = None
        if idx.size >= 2:
            rows, cols = np.triu_indices(idx.size, 1)  # row-major: (a, b) in lexicographic order
            values = a[idx[rows], idx[cols]]
            j = int(np.argmax(values))  # first maximum: the lowest (a, b)
            pair = (int(idx[rows[j]]), int(idx[cols[j]]), float(values[j]))
        join: tuple[int, int, float] | None = None
        if members:
            sizes = np.array([len(m) for m in members], dtype=np.float64)
            csim = (sums[:, idx] / sizes[:, None]).T  # free clients x clusters
            j = int(np.argmax(csim))  # row-major: the lowest client, then the lowest cluster
            row, col = divmod(j, len(members))
            join = (int(idx[row]), col, float(csim[row, col]))
        if join is not None and (pair is None or join[2] >= pair[2]):
            client, cluster, _ = join
            members[cluster].append(client)
            sums[cluster] += a[client]
            free[client] = False
        else:
            new = [pair[0], pair[1]] if pair is not None else [int(idx[0])]
            members.append(new)
            sums = np.vstack([sums, a[new].sum(0)])
            free[new] = False
    unclustered: list[int] = []
    if free.any():
        sizes = np.array([len(m) for m in members], dtype=np.float64)
        frozen = sums / sizes[:, None]  # memberships frozen at the cap
        for client in np.flatnonzero(free).tolist():
            cluster = int(np.argmax(frozen[:, client]))
            if frozen[cluster, client] > threshold:
                members[cluster].append(client)
            else:
                unclustered.append(client)
    return [sorted(m) for m in members], unclustered


def macro_classes(mic: torch.Tensor, clusters: Sequence[Sequence[int]], codes: int) -> torch.Tensor:
    """MAC_s = per-position mode of the members' MIC bins (Eq. 11), S x M_h int64; a tie takes the
    smaller bin."""
    out = torch.empty(len(clusters), mic.shape[1], dtype=torch.int64, device=mic.device)
    for s, members in enumerate(clusters):
        sub = mic[list(members)]
        best = torch.zeros(mic.shape[1], dtype=torch.int64, device=mic.device)
        mode = torch.ones_like(best)
        for c in range(1, codes + 1):
            count = (sub == c).sum(0)
            better = count > best  # strictly: an equal count keeps the smaller bin
            best = torch.where(better, count, best)
            mode = torch.where(better, torch.full_like(mode, c), mode)
        out[s] = mode
    return out


def cluster_weights(
    mac: torch.Tensor, masses: torch.Tensor, weighting: str, c_mic: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """alpha~_s[m], S x M_h, summing to 1 over clusters at every position (Eq. 14, normalised).

    "count": a_s[m] = n_{s, MAC_s[m]}, the number of the layer's high-dispersion positions where
    cluster s has the same MAC bin as at m; "size": a_s = masses[s]; "inverse_bin": a_s[m] =
    1 / magnitude of MAC_s[m] (the bin modulo C_mic, for signed codes)."""
    if weighting == "count":
        s, width = mac.shape[0], int(mac.max()) + 1
        offsets = torch.arange(s, device=mac.device).unsqueeze(1) * width
        n = torch.bincount((mac + offsets).reshape(-1), minlength=s * width).view(s, width)
        a = n.gather(1, mac).to(dtype)
    elif weighting == "size":
        a = masses.to(dtype).unsqueeze(1).expand(mac.shape)
    elif weighting == "inverse_bin":
        a = ((mac - 1) % c_mic + 1).to(dtype).reciprocal()
    else:
        raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    return a / a.sum(0, keepdim=True)


def skew_aware_layer(
    rows: Sequence[torch.Tensor], p: Sequence[float], hp: SkewAwareOptions, name: str = ""
) -> tuple[torch.Tensor, LayerStats]:
    """SA on one tensor: `rows` are the K clients' flat copies W[k] (M values each, floating, on one
    device: a K x M matrix works too), `p` their normalised weights (1 / K each unless
    `hp.weighted`). Returns the aggregated M values and what happened.

    The statistics over all M positions stream over the K rows (vector ops over all positions,
    like `weighted_average`), so the only K-sized copies are of the M_h high-dispersion positions."""
    k, m = len(rows), rows[0].numel()
    mu = client_mean(rows, p)
    plain = (mu, LayerStats(name, m, 0))
    if k < 2 or m < 2:
        return plain
    cv = coefficient_of_variation(client_variance(rows, mu, p), mu, hp.eps)
    high = high_dispersion(cv, hp.cv_t, hp.cv_clip_quantile)
    del cv
    idx = high.nonzero().squeeze(1)
    m_h = idx.numel()
    if m_h == 0:
        return plain
    w_h = torch.stack([row[idx] for row in rows])  # K x M_h
    dev = w_h - mu[idx]
    above = dev > 0 if hp.signed else None
    mic = micro_classes(dev.square_(), hp.c_mic, hp.bins, above)  # Eq. 3 on the high positions, then Eq. 8
    del dev, above
    codes = 2 * hp.c_mic if hp.signed else hp.c_mic
    counts = agreement_counts(mic, codes)
    clusters, unclustered = greedy_cluster(counts, hp.s_mac, hp.sim_t * m_h)
    mac = macro_classes(mic, clusters, codes)
    # membership weights (Eq. 12): the members' mean, uniform or by sample weight
    member = torch.zeros(len(clusters), k, dtype=torch.float64)
    for c, ks in enumerate(clusters):
        member[c, ks] = torch.tensor([p[i] for i in ks], dtype=torch.float64) if hp.weighted else 1.0
    masses = member.sum(1)
    member = (member / masses.unsqueeze(1)).to(w_h.device, w_h.dtype)
    wbar = member @ w_h  # S x M_h
    alpha = cluster_weights(mac, masses.to(w_h.device), hp.weighting, hp.c_mic, w_h.dtype)
    out = mu.clone()
    out[idx] = (alpha * wbar).sum(0)  # Eq. 15 on the high positions; Eq. 13: the rest keep mu
    return out, LayerStats(name, m, m_h, tuple(tuple(c) for c in clusters), tuple(unclustered))


def skew_aware_average(
    states: Sequence[StateDict],
    weights: Sequence[float],
    hp: SkewAwareOptions,
    *,
    frozen: Collection[str] = (),
    device: torch.device | None = None,
    report: list[LayerStats] | None = None,
) -> StateDict:
    """SA over whole models, with `weighted_average`'s contract: floating tensors aggregated,
    integer ones the maximum, deterministic for the order given (updates arrive sorted by node id),
    the result on the inputs' device and in their dtype.

    `weights` count only when `hp.weighted`. `frozen` names the non-trainable entries (buffers),
    which take the mean or the first copy (`hp.buffers`). `device` is where the per-tensor work runs
    (the coordinator's accelerator); `report`, if given, receives one `LayerStats` per SA tensor.
    """
    if not states or len(states) != len(weights):
        raise ValueError("skew_aware_average needs as many weights as states, and at least one")
    k = len(states)
    if hp.weighted:
        if not all(math.isfinite(float(w)) and float(w) >= 0 for w in weights):
            raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
        total = float(sum(weights))
        if total <= 0:
            raise ValueError("weights must sum to a positive number")
        p = [float(w) / total for w in weights]
    else:
        p = [1.0 / k] * k  # what weighted_average computes for weights all 1
    out: StateDict = {}
    for name, first in states[0].items():
        if any(state[name].shape != first.shape for state in states):
            raise ValueError(f"tensor {name} has different shapes across the updates")
        if not first.is_floating_point():
            out[name] = first.clone() if hp.buffers == "first" else torch.stack([s[name] for s in states]).amax(0)
            continue
        if name in frozen and hp.buffers == "first":
            out[name] = first.clone()
            continue
        acc = torch.float64 if first.dtype == torch.float64 else torch.float32
        where = device if device is not None else first.device
        rows = [s[name].reshape(-1).to(where, acc) for s in states]  # views when no conversion is needed
        if name in frozen:
            flat = client_mean(rows, p)
        else:
            flat, stats = skew_aware_layer(rows, p, hp, name)
            if report is not None:
                report.append(stats)
        out[name] = flat.reshape(first.shape).to(first.device, first.dtype)
    return out


def non_trainable(model: nn.Module) -> frozenset[str]:
    """State-dict names of `model`'s buffers and of its parameters that do not require gradients."""
    names = {name for name, _ in model.named_buffers()}
    names |= {name for name, p in model.named_parameters() if not p.requires_grad}
    return frozenset(names)


class SkewAwareAggregator:
    """SA as an `Aggregator` (``(states, weights) -> state``) for any method's ``self.average``;
    it keeps the statistics of its last call (`metrics`, `layers`)."""

    def __init__(
        self, hp: SkewAwareOptions, *, frozen: Collection[str] = (), device: torch.device | None = None
    ) -> None:
        self.hp = hp
        self.frozen = frozenset(frozen)
        """Non-trainable entries (buffers): plain mean or first copy, never SA."""
        self.device = device
        self.layers: list[LayerStats] = []
        """One record per tensor that went through SA in the last call."""

    def bind(self, model: nn.Module, device: torch.device | None = None) -> SkewAwareAggregator:
        """Learn `model`'s non-trainable entries (and where to compute); returns self."""
        self.frozen = non_trainable(model)
        if device is not None:
            self.device = device
        return self

    def __call__(self, states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
        self.layers = []
        return skew_aware_average(states, weights, self.hp, frozen=self.frozen, device=self.device, report=self.layers)

    @property
    def metrics(self) -> dict[str, float]:
        """The last call's summary: share of high-dispersion parameters over the SA tensors, tensors
        clustered, mean clusters and mean unclustered clients per clustered tensor."""
        size = sum(layer.size for layer in self.layers)
        clustered = [layer for layer in self.layers if layer.high]
        n = len(clustered)
        return {
            "sa_high_share": sum(layer.high for layer in self.layers) / size if size else 0.0,
            "sa_layers_clustered": float(n),
            "sa_clusters_mean": sum(len(layer.clusters) for layer in clustered) / n if n else 0.0,
            "sa_unclustered_mean": sum(len(layer.unclustered) for layer in clustered) / n if n else 0.0,
        }


def aggregator(
    hp: SkewAwareOptions, *, model: nn.Module | None = None, device: torch.device | None = None
) -> SkewAwareAggregator:
    """SA with options `hp`, for ``self.average`` of any averaging method; pass the `model` (or call
    `bind`) so that its buffers take the plain mean rather than SA."""
    out = SkewAwareAggregator(hp, device=device)
    return out.bind(model) if model is not None else out
