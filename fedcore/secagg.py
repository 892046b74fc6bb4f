"""Secure aggregation's cryptography: SecAgg+ (semi-honest), pure and synchronous, without MQTT.

Bell, Bonawitz, Gascon, Lepoint and Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020 (https://eprint.iacr.org/2020/704), which refines Bonawitz et al., CCS 2017. Each
node u of a round attempt holds two fresh X25519 key pairs (c: its shares are encrypted to it; s: it
agrees pairwise masks with it) and a random 32-byte self-mask seed b_u. It sends

    y_u = q(x_u) + PRG(b_u) + sum_{v in N(u), u < v} PRG(s_uv) - sum_{v in N(u), v < u} PRG(s_uv)   (mod 2^32)

where q is fixed point (`quantise`), N(u) its neighbours in the round's masking graph (everyone in
SecAgg, a few in SecAgg+) that shared in time, and s_uv = HKDF(X25519(s_u, s_v)), the same seed for
u and v, so the pairwise masks cancel in the sum of all y_u. Before masking, u Shamir-shares b_u
and its private s key among its neighbours (threshold t), each neighbour's pair encrypted to it
(AES-GCM under a key agreed from the c keys), through the coordinator, which cannot read them.

To unmask, the coordinator asks each survivor (whose y reached it) for its shares of every
surviving neighbour's b and of every neighbour that shared but dropped's s key; it rebuilds each
secret from t shares and removes PRG(b_u) of each survivor and the pairwise masks the survivors
added for each dropout. What it learns: the sum of the survivors' q(x_u), and nothing of one x_u,
because a node never reveals both kinds of share for one neighbour (`NodeSecAgg.reveal`): for a
survivor it would need b_u (then the pairwise masks still hide x_u, and s_u is never revealed while
u survives), for a dropout its y never arrived. A coalition of the coordinator with fewer than t of
u's neighbours has fewer than t shares of either secret. Keys are ephemeral (one attempt): revealing
a dropout's s key costs it nothing in later rounds. `RoundKey` binds every derived key and every
ciphertext to the federation, round and attempt, so a share from another attempt does not decrypt.

Quantisation is exact arithmetic after rounding: each entry's error is at most half a unit of
1 / `SecAggSettings.scale`, so a sum of K vectors is off by at most `error_bound(K)`.

Libraries: `cryptography` (X25519, HKDF-SHA256, AES-GCM, AES-256-CTR as the mask PRG) and
pycryptodome's Shamir sharing (16-byte secrets: a 32-byte one is shared as two halves).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MODULUS_BITS = 32
"""Masked entries are integers mod 2^32, sent as uint32 bit patterns (as many bytes as float32)."""
SEED_BYTES = 32
SHARE_BYTES = 34
"""A share: its 2-byte index, then the shares of the secret's two 16-byte halves."""
NONCE_BYTES = 12
SEARCH_LIMIT = 2000
"""Subsets of shares tried when the first t do not rebuild a secret that checks (a forged share)."""


class SecAggError(ValueError):
    """The protocol cannot go on: a forged or replayed share, too few shares, a malformed key, or an
    unmask request a node must refuse. `reason` is a short counter name, `nodes` whom it concerns."""

    def __init__(self, reason: str, detail: str, *, nodes: Sequence[str] = ()) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.nodes = tuple(nodes)


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggSettings:
    """How a federation's secure aggregation masks (the experiment's ``privacy.secure_aggregation``)."""

    neighbours: int = 0
    """Each node's neighbours in the masking graph (SecAgg+); 0: every other participant (SecAgg)."""
    threshold: float = 0.5
    """The share of a node's neighbours whose shares rebuild its secrets."""
    clip: float = 8.0
    """Each entry of a node's (already weighted) vector is clipped to [-clip, clip]."""
    l2_clip: float | None = None
    """With central DP (`fedcore.privacy`): each node clips its change to this L2 norm (S) and weighs
    it 1 / K, K the directory's weight total (the cohort), instead of by its samples: the unmasked
    sum is DP-FedAvg's sum_k clip(d_k) / K, to which the coordinator adds the noise."""
    fixed_total: int | None = None
    """With `l2_clip`, on the coordinator: the weight total it sends (DP-FedAvg's fixed denominator K;
    a node's settings need not hold it)."""

    def __post_init__(self) -> None:
        if self.fixed_total is not None and self.l2_clip is None:
            raise ValueError("fixed_total is for central DP with secure aggregation: it needs l2_clip")
        if self.l2_clip is not None and not (math.isfinite(self.l2_clip) and self.l2_clip > 0):
            raise ValueError(f"l2_clip must be a finite number > 0, not {self.l2_clip!r}")
        if self.fixed_total is not None and (isinstance(self.fixed_total, bool) or self.fixed_total < 1):
            raise ValueError(f"fixed_total must be a whole number >= 1, not {self.fixed_total!r}")
        if isinstance(self.neighbours, bool) or not isinstance(self.neighbours, int) or self.neighbours < 0:
            raise ValueError(f"neighbours must be a whole number >= 0, not {self.neighbours!r}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], not {self.threshold!r}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be a finite number > 0, not {self.clip!r}")

    def shares_needed(self, neighbours: int) -> int:
        """t for a node with `neighbours` neighbours: max(2, ceil(threshold x neighbours)), at most them."""
        if neighbours < 2:
            raise ValueError(f"a node with {neighbours} neighbour(s) cannot hide its mask (2 at least)")
        return min(neighbours, max(2, math.ceil(self.threshold * neighbours - 1e-9)))

    @property
    def scale(self) -> float:
        """Fixed-point units per 1.0: the clip range fills a quarter of the modulus, so that a sum of
        weighted vectors (weights summing to at most 1) and its rounding stay within the signed half."""
        return 2.0 ** (MODULUS_BITS - 2) / self.clip

    def error_bound(self, summands: int) -> float:
        """The largest error quantisation adds to one entry of a sum of `summands` vectors."""
        return summands * 0.5 / self.scale


@dataclass(frozen=True, slots=True)
class RoundKey:
    """What binds every key, share and mask to one round attempt of one federation."""

    federation: str
    round: int
    attempt: int

    def info(self, *parts: str) -> bytes:
        """An unambiguous byte string of the attempt and `parts` (each field length-prefixed): HKDF's
        info and AES-GCM's associated data."""
        fields = ["fedmq-secagg", self.federation, str(self.round), str(self.attempt), *parts]
        return b"".join(len(f.encode()).to_bytes(4, "big") + f.encode() for f in fields)


def neighbour_graph(participants: Sequence[str], degree: int, seed: bytes) -> dict[str, tuple[str, ...]]:
    """Each participant's neighbours (sorted), symmetric: the complete graph for degree 0 or n - 1 and
    more; else a ring of the participants in an order `seed` shuffles, each linked to degree / 2
    (rounded up) on each side (a Harary graph: every node has the same number of neighbours)."""
    nodes = sorted(set(participants))
    n = len(nodes)
    if n < 3:
        raise ValueError(f"a masking graph needs 3 participants at least, got {n}")
    half = (degree + 1) // 2
    if degree == 0 or 2 * half >= n - 1:
        return {v: tuple(u for u in nodes if u != v) for v in nodes}
    order = sorted(nodes, key=lambda v: hmac.new(seed, v.encode(), hashlib.sha256).digest())
    links: dict[str, set[str]] = {v: set() for v in nodes}
    for i, v in enumerate(order):
        for j in range(1, half + 1):
            links[v].update((order[(i + j) % n], order[(i - j) % n]))
    return {v: tuple(sorted(links[v])) for v in nodes}


# -- arithmetic ----------------------------------------------------------------------------------------


def quantise(vector: np.ndarray, settings: SecAggSettings) -> tuple[np.ndarray, int]:
    """`vector` clipped to [-clip, clip] in fixed point mod 2^32 (uint32), and how many entries the
    clip changed. SecAggError for an entry that is not finite (it has no fixed point)."""
    x = np.asarray(vector, dtype=np.float64).reshape(-1)
    if not np.isfinite(x).all():
        raise SecAggError("non-finite", "the vector to mask holds NaN or inf")
    clipped = np.clip(x, -settings.clip, settings.clip)
    changed = int(np.count_nonzero(clipped != x))
    fixed = np.rint(clipped * settings.scale).astype(np.int64)
    return (fixed & 0xFFFFFFFF).astype(np.uint32), changed


def dequantise(total: np.ndarray, settings: SecAggSettings) -> np.ndarray:
    """A sum of quantised vectors (uint32, mod 2^32) as float64, read as a signed number."""
    signed = np.asarray(total, dtype=np.uint32).astype(np.int64)
    signed[signed >= 1 << (MODULUS_BITS - 1)] -= 1 << MODULUS_BITS
    return signed / settings.scale


def sum_mod(vectors: Iterable[np.ndarray]) -> np.ndarray:
    """The sum of uint32 vectors modulo 2^32 (unmasking's first step; a replay's whole sum, whose
    recomputed vectors carry no masks)."""
    total: np.ndarray | None = None
    for vector in vectors:
        flat = np.asarray(vector, dtype=np.uint32).reshape(-1)
        total = flat.copy() if total is None else total + flat
    if total is None:
        raise ValueError("no vector to sum")
    return total


def prg(seed: bytes, length: int) -> np.ndarray:
    """`length` pseudorandom uint32 from a 32-byte seed: the AES-256-CTR keystream (zero nonce: every
    seed is used for one vector only)."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * length)), dtype="<u4")


def _agree(private: X25519PrivateKey, public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 over the X25519 shared secret."""
    try:
        secret = private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # not 32 bytes, or a low-order point (an all-zero secret)
        raise SecAggError("bad-key", f"a public key is not a usable X25519 key ({exc})") from None
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def _split(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """`count` shares of a 32-byte secret, any `threshold` of which rebuild it (share j has index j + 1)."""
    low = Shamir.split(threshold, count, secret[:16])
    high = Shamir.split(threshold, count, secret[16:])
    return [index.to_bytes(2, "big") + a + b for (index, a), (_, b) in zip(low, high, strict=True)]


def _combine(shares: Sequence[bytes]) -> bytes:
    low = [(int.from_bytes(s[:2], "big"), s[2:18]) for s in shares]
    high = [(int.from_bytes(s[:2], "big"), s[18:34]) for s in shares]
    return bytes(Shamir.combine(low) + Shamir.combine(high))


def commitment(key: RoundKey, node: str, seed: bytes) -> bytes:
    """What a node commits its self-mask seed with: the coordinator checks the seed it rebuilds."""
    return hashlib.sha256(key.info("commit", node) + seed).digest()


# -- the node's side ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MaskedVector:
    values: np.ndarray
    """uint32, as long as the vector masked."""
    clipped: int
    """Entries the clip changed."""


@dataclass(frozen=True, slots=True)
class Reveal:
    b_shares: dict[str, bytes]
    """Per surviving neighbour, this node's share of its self-mask seed."""
    s_shares: dict[str, bytes]
    """Per dropped neighbour, this node's share of its mask key."""


class NodeSecAgg:
    """One node's side of one round attempt (module docstring): its keys, seed, and what it sent."""

    def __init__(
        self, settings: SecAggSettings, key: RoundKey, node: str, *, random: Callable[[int], bytes] = os.urandom
    ) -> None:
        self.settings = settings
        self.key = key
        self.node = node
        self._c = X25519PrivateKey.generate()
        self._s = X25519PrivateKey.generate()
        self._b = random(SEED_BYTES)
        if len(self._b) != SEED_BYTES:
            raise ValueError(f"random({SEED_BYTES}) gave {len(self._b)} bytes")
        self._neighbours: dict[str, tuple[bytes, bytes]] | None = None
        self._revealed = False
        self._masked = False

    def public_keys(self) -> tuple[bytes, bytes]:
        """(encryption key, mask key), raw 32 bytes each."""
        return self._c.public_key().public_bytes_raw(), self._s.public_key().public_bytes_raw()

    def share(self, neighbours: Mapping[str, tuple[bytes, bytes]]) -> tuple[bytes, dict[str, bytes]]:
        """Shamir-share b and the mask key among `neighbours` (their (encryption, mask) keys), each
        neighbour's pair encrypted to it: (the commitment to b, {neighbour: ciphertext})."""
        if self._neighbours is not None:
            raise SecAggError("unmask-refused", f"{self.node} shared its secrets once already this attempt")
        if self.node in neighbours:
            raise SecAggError("bad-key", f"{self.node} is listed among its own neighbours")
        order = sorted(neighbours)
        try:
            threshold = self.settings.shares_needed(len(order))
        except ValueError as exc:
            raise SecAggError("too-few-shares", str(exc)) from None
        for v in order:
            encryption, mask = neighbours[v]
            if len(encryption) != 32 or len(mask) != 32:
                raise SecAggError("bad-key", f"{v}'s keys are not 32 bytes each", nodes=(v,))
        seed_shares = _split(self._b, threshold, len(order))
        key_shares = _split(self._s.private_bytes_raw(), threshold, len(order))
        sealed: dict[str, bytes] = {}
        for v, seed_share, key_share in zip(order, seed_shares, key_shares, strict=True):
            aead = AESGCM(_agree(self._c, neighbours[v][0], self.key.info("share-key", *_pair(self.node, v))))
            nonce = os.urandom(NONCE_BYTES)
            sealed[v] = nonce + aead.encrypt(nonce, seed_share + key_share, self.key.info("share", self.node, v))
        for v in order:  # the mask keys must be usable before anything is sent
            _agree(self._s, neighbours[v][1], self.key.info("mask", *_pair(self.node, v)))
        self._neighbours = {v: (bytes(neighbours[v][0]), bytes(neighbours[v][1])) for v in order}
        return commitment(self.key, self.node, self._b), sealed

    def mask(self, vector: np.ndarray, shared: Collection[str]) -> MaskedVector:
        """`vector` (weighted by the caller) quantised, plus the self mask and the pairwise masks of
        the neighbours in `shared` (those whose shares reached the coordinator)."""
        if self._neighbours is None:
            raise SecAggError("unmask-refused", f"{self.node} masks only after sharing its secrets")
        if self._masked:  # two vectors under the same masks would give away their difference
            raise SecAggError("unmask-refused", f"{self.node} masked a vector once already this attempt")
        self._masked = True
        strangers = sorted(set(shared) - set(self._neighbours))
        if strangers:
            raise SecAggError(
                "unmask-refused", f"{', '.join(strangers)} are not {self.node}'s neighbours", nodes=strangers
            )
        values, clipped = quantise(vector, self.settings)
        total = values + prg(self._b, len(values))
        for v in sorted(shared):
            seed = _agree(self._s, self._neighbours[v][1], self.key.info("mask", *_pair(self.node, v)))
            pad = prg(seed, len(values))
            total = total + pad if self.node < v else total - pad
        return MaskedVector(total, clipped)

    def reveal(self, ciphertexts: Mapping[str, bytes], survivors: Collection[str], dropped: Collection[str]) -> Reveal:
        """The b-share of each survivor and the s-share of each dropped node, decrypted from the
        neighbours' `ciphertexts` (sender -> ciphertext addressed to this node); once an attempt, and
        never both for one node."""
        if self._neighbours is None:
            raise SecAggError("unmask-refused", f"{self.node} has shared nothing to reveal")
        if self._revealed:
            raise SecAggError("unmask-refused", f"{self.node} revealed its shares once already this attempt")
        self._revealed = True  # even if this request is refused: a second one must not be answered
        both = sorted(set(survivors) & set(dropped))
        if both:
            raise SecAggError("unmask-refused", f"asked both shares of {', '.join(both)}", nodes=both)
        strangers = sorted((set(survivors) | set(dropped)) - set(self._neighbours))
        if strangers:
            raise SecAggError(
                "unmask-refused", f"{', '.join(strangers)} are not {self.node}'s neighbours", nodes=strangers
            )
        b_shares: dict[str, bytes] = {}
        s_shares: dict[str, bytes] = {}
        for v in sorted({*survivors, *dropped}):
            sealed = ciphertexts.get(v)
            if sealed is None or len(sealed) <= NONCE_BYTES:
                raise SecAggError("forged-share", f"no share from {v} to reveal", nodes=(v,))
            aead = AESGCM(_agree(self._c, self._neighbours[v][0], self.key.info("share-key", *_pair(self.node, v))))
            try:
                plain = aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], self.key.info("share", v, self.node))
            except InvalidTag:
                raise SecAggError(
                    "forged-share",
                    f"{v}'s share does not decrypt (tampered, replayed, or not for {self.node})",
                    nodes=(v,),
                ) from None
            if len(plain) != 2 * SHARE_BYTES:
                raise SecAggError("forged-share", f"{v}'s share has {len(plain)} bytes", nodes=(v,))
            if v in survivors:
                b_shares[v] = plain[:SHARE_BYTES]
            else:
                s_shares[v] = plain[SHARE_BYTES:]
        return Reveal(b_shares, s_shares)


# -- the coordinator's side ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unmasked:
    total: np.ndarray
    """float64: the dequantised sum of the survivors' vectors."""
    bad_shares: tuple[tuple[str, str], ...]
    """(revealer, owner) of each share found inconsistent and left out."""


def _rebuild(
    owner: str, shares: Mapping[str, bytes], needed: int, check: Callable[[bytes], bool], bad: list[tuple[str, str]]
) -> bytes:
    """`owner`'s secret from `needed` of its `shares` (by revealer) that `check` accepts; the shares
    inconsistent with it are added to `bad`."""
    revealers = sorted(shares)
    if len(revealers) < needed:
        raise SecAggError(
            "too-few-shares", f"{owner}'s secret needs {needed} shares and {len(revealers)} came", nodes=(owner,)
        )

    def attempt(subset: Sequence[str]) -> bytes | None:
        try:
            secret = _combine([shares[r] for r in subset])
        except ValueError:  # duplicate or malformed indices
            return None
        return secret if check(secret) else None

    found = attempt(revealers[:needed])
    subset: Sequence[str] = revealers[:needed]
    if found is None:
        for tries, candidate in enumerate(itertools.combinations(revealers, needed)):
            if tries >= SEARCH_LIMIT:
                break
            found = attempt(candidate)
            if found is not None:
                subset = candidate
                break
        if found is None:
            raise SecAggError("forged-share", f"no {needed} of {owner}'s shares rebuild its secret", nodes=(owner,))
        base = list(subset[: needed - 1])
        for r in revealers:
            if r not in subset and attempt([*base, r]) is None:
                bad.append((r, owner))
    return found


def unmask(
    settings: SecAggSettings,
    key: RoundKey,
    *,
    masked: Mapping[str, np.ndarray],
    graph: Mapping[str, Sequence[str]],
    shared: Collection[str],
    public_keys: Mapping[str, tuple[bytes, bytes]],
    commitments: Mapping[str, bytes],
    b_shares: Mapping[str, Mapping[str, bytes]],
    s_shares: Mapping[str, Mapping[str, bytes]],
) -> Unmasked:
    """The sum of the survivors' (`masked`) vectors, never any one of them (module docstring).
    SecAggError when a secret has too few shares, or none of its share subsets checks."""
    survivors = sorted(masked)
    if not survivors:
        raise SecAggError("too-few-shares", "no masked vector to unmask")
    outsiders = sorted(set(survivors) - set(shared))
    if outsiders:
        raise SecAggError("unmask-refused", f"{', '.join(outsiders)} sent a vector but never shared", nodes=outsiders)
    lengths = {np.asarray(v).size for v in masked.values()}
    if len(lengths) != 1:
        raise SecAggError("unmask-refused", f"the masked vectors differ in length: {sorted(lengths)}")
    length = lengths.pop()
    total = sum_mod(masked[u] for u in survivors)
    bad: list[tuple[str, str]] = []
    for u in survivors:
        needed = settings.shares_needed(len(graph[u]))

        def committed(secret: bytes, u: str = u) -> bool:
            return commitment(key, u, secret) == commitments[u]

        total -= prg(_rebuild(u, b_shares.get(u, {}), needed, committed, bad), length)
    for d in sorted(set(shared) - set(survivors)):
        needed = settings.shares_needed(len(graph[d]))

        def matches(secret: bytes, d: str = d) -> bool:
            return X25519PrivateKey.from_private_bytes(secret).public_key().public_bytes_raw() == public_keys[d][1]

        private = X25519PrivateKey.from_private_bytes(_rebuild(d, s_shares.get(d, {}), needed, matches, bad))
        for u in graph[d]:
            if u not in masked:
                continue
            pad = prg(_agree(private, public_keys[u][1], key.info("mask", *_pair(u, d))), length)
            if u < d:
                total -= pad  # u added it
            else:
                total += pad  # u subtracted it
    return Unmasked(dequantise(total, settings), tuple(bad))
