"""SecAgg+'s cryptography (`fedcore.secagg`) on synthetic vectors (random numbers, clearly not data):
the masks cancel exactly, dropouts are recovered from the shares while each secret keeps its
threshold, forged and replayed shares are refused, and a node never reveals both of a node's shares."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from fedmq.fedcore.secagg import (
    NodeSecAgg,
    RoundKey,
    SecAggError,
    SecAggSettings,
    Unmasked,
    dequantise,
    neighbour_graph,
    quantise,
    unmask,
)

KEY = RoundKey("fed", 3, 0)
SETTINGS = SecAggSettings(clip=1.0)


class Round:
    """A round attempt of `n` nodes played through every step, the coordinator's part by hand."""

    def __init__(self, n: int, *, settings: SecAggSettings = SETTINGS, length: int = 1000, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.settings = settings
        self.ids = [f"node-{i:03d}" for i in range(n)]
        self.vectors = {v: rng.uniform(-0.5, 0.5, length) / n for v in self.ids}
        self.nodes = {v: NodeSecAgg(settings, KEY, v) for v in self.ids}
        self.keys = {v: node.public_keys() for v, node in self.nodes.items()}
        self.graph = neighbour_graph(self.ids, settings.neighbours, b"graph")
        self.commitments: dict[str, bytes] = {}
        self.sealed: dict[str, dict[str, bytes]] = {}
        for v in self.ids:
            self.commitments[v], self.sealed[v] = self.nodes[v].share({u: self.keys[u] for u in self.graph[v]})

    def inbox(self, v: str) -> dict[str, bytes]:
        """The ciphertexts addressed to v by its neighbours."""
        return {u: self.sealed[u][v] for u in self.graph[v]}

    def masked(self, survivors: Sequence[str]) -> dict[str, np.ndarray]:
        return {v: self.nodes[v].mask(self.vectors[v], self.graph[v]).values for v in survivors}

    def unmask(self, survivors: Sequence[str], revealers: Sequence[str] | None = None) -> Unmasked:
        masked = self.masked(survivors)
        dropped = [v for v in self.ids if v not in survivors]
        seed_shares: dict[str, dict[str, bytes]] = {}
        key_shares: dict[str, dict[str, bytes]] = {}
        for v in revealers if revealers is not None else survivors:
            mine = self.graph[v]
            reveal = self.nodes[v].reveal(
                self.inbox(v), [u for u in mine if u in survivors], [u for u in mine if u in dropped]
            )
            for owner, share in reveal.b_shares.items():
                seed_shares.setdefault(owner, {})[v] = share
            for owner, share in reveal.s_shares.items():
                key_shares.setdefault(owner, {})[v] = share
        return unmask(
            self.settings, KEY, masked=masked, graph=self.graph, shared=self.ids, public_keys=self.keys,
            commitments=self.commitments, b_shares=seed_shares, s_shares=key_shares,
        )  # fmt: skip

    def exact(self, survivors: Sequence[str]) -> np.ndarray:
        """The sum of the survivors' quantised vectors, computed in the clear."""
        total = sum((quantise(self.vectors[v], self.settings)[0] for v in survivors), np.zeros(1, np.uint32))
        return dequantise(total, self.settings)


@pytest.mark.parametrize(("n", "neighbours"), [(5, 0), (12, 4)])
def test_the_masks_cancel_exactly_and_the_sum_is_within_the_quantisation_bound(n: int, neighbours: int) -> None:
    play = Round(n, settings=SecAggSettings(neighbours=neighbours, clip=1.0))
    result = play.unmask(play.ids)
    assert np.array_equal(result.total, play.exact(play.ids)) and result.bad_shares == ()
    plain = sum(play.vectors.values())
    assert np.abs(result.total - plain).max() <= play.settings.error_bound(n)


def test_a_masked_vector_alone_says_nothing_of_its_input() -> None:
    play = Round(5)
    for v, values in play.masked(play.ids).items():
        assert abs(np.corrcoef(values.astype(np.float64), play.vectors[v])[0, 1]) < 0.15
        assert values.astype(np.float64).mean() / 2**32 == pytest.approx(0.5, abs=0.05)


def test_a_node_that_drops_after_sharing_is_recovered_from_its_neighbours_shares() -> None:
    play = Round(6)
    survivors = play.ids[1:]
    assert np.array_equal(play.unmask(survivors).total, play.exact(survivors))


def test_a_survivor_that_does_not_reveal_is_fine_while_every_secret_keeps_its_threshold() -> None:
    play = Round(6)  # 5 neighbours each, t = 3
    assert np.array_equal(play.unmask(play.ids, revealers=play.ids[:4]).total, play.exact(play.ids))


def test_too_few_shares_name_the_node_whose_secret_cannot_be_rebuilt() -> None:
    play = Round(6)
    with pytest.raises(SecAggError) as caught:
        play.unmask(play.ids, revealers=play.ids[:2])
    # node-000's seed is shared among the others: of the two revealers, only node-001 holds a share of it
    assert caught.value.reason == "too-few-shares" and caught.value.nodes == ("node-000",)
    assert "needs 3 shares and 1 came" in str(caught.value)


def test_a_tampered_ciphertext_is_refused_naming_its_sender() -> None:
    play = Round(5)
    v, u = play.ids[0], play.ids[1]
    inbox = play.inbox(v)
    inbox[u] = inbox[u][:-1] + bytes([inbox[u][-1] ^ 1])
    with pytest.raises(SecAggError) as caught:
        play.nodes[v].reveal(inbox, [u], [])
    assert caught.value.reason == "forged-share" and caught.value.nodes == (u,)


def test_a_ciphertext_of_another_attempt_or_for_another_node_is_refused() -> None:
    """A replay: the same node with the same keys in attempt 1 cannot open attempt 0's share (the
    attempt is bound into the key and the associated data), and a share for one neighbour does not
    open for another."""
    play = Round(5)
    v, u, w = play.ids[:3]
    later = NodeSecAgg(SETTINGS, RoundKey("fed", 3, 1), v)
    later._c = play.nodes[v]._c
    later.share({x: play.keys[x] for x in play.graph[v]})
    with pytest.raises(SecAggError, match="forged-share"):
        later.reveal(play.inbox(v), [u], [])
    with pytest.raises(SecAggError, match="forged-share"):
        play.nodes[v].reveal({u: play.sealed[u][w]}, [u], [])


def test_a_share_an_insider_alters_is_found_with_spare_shares_and_refused_without() -> None:
    play = Round(7)  # 6 neighbours each, t = 3
    masked = play.masked(play.ids)
    seed_shares: dict[str, dict[str, bytes]] = {}
    for v in play.ids:
        for owner, share in play.nodes[v].reveal(play.inbox(v), play.graph[v], []).b_shares.items():
            seed_shares.setdefault(owner, {})[v] = share
    victim = play.ids[0]
    liar = sorted(seed_shares[victim])[0]
    forged = bytearray(seed_shares[victim][liar])
    forged[5] ^= 0xFF
    seed_shares[victim][liar] = bytes(forged)
    common = {
        "masked": masked, "graph": play.graph, "shared": play.ids, "public_keys": play.keys,
        "commitments": play.commitments, "s_shares": {},
    }  # fmt: skip
    result = unmask(play.settings, KEY, b_shares=seed_shares, **common)  # type: ignore[arg-type]
    assert (liar, victim) in result.bad_shares and np.array_equal(result.total, play.exact(play.ids))
    only = sorted(seed_shares[victim])[:3]
    seed_shares[victim] = {r: seed_shares[victim][r] for r in only}
    with pytest.raises(SecAggError, match="forged-share"):
        unmask(play.settings, KEY, b_shares=seed_shares, **common)  # type: ignore[arg-type]


def test_a_node_masks_once_an_attempt() -> None:
    """Two vectors masked under the same seeds would give away their difference."""
    play = Round(5)
    play.masked(play.ids)
    with pytest.raises(SecAggError, match="masked a vector once already"):
        play.nodes[play.ids[0]].mask(play.vectors[play.ids[0]], play.graph[play.ids[0]])


def test_a_node_reveals_once_and_never_both_shares_of_a_node() -> None:
    play = Round(5)
    v, u, w = play.ids[:3]
    with pytest.raises(SecAggError, match="both shares of"):
        play.nodes[v].reveal(play.inbox(v), [u], [u])
    with pytest.raises(SecAggError, match="once already"):  # the refused request used its one reveal
        play.nodes[v].reveal(play.inbox(v), [u], [w])
    other = Round(5, seed=1)
    with pytest.raises(SecAggError, match="not node-001's neighbours"):
        other.nodes[u].reveal(other.inbox(u), ["node-999"], [])


def test_share_refuses_a_key_that_is_not_a_usable_point() -> None:
    play = Round(5)
    node = NodeSecAgg(SETTINGS, KEY, "node-x")
    with pytest.raises(SecAggError, match="bad-key"):
        node.share({"node-000": (bytes(32), play.keys["node-000"][1]), "node-001": play.keys["node-001"]})
    with pytest.raises(SecAggError, match="bad-key"):
        node.share({"node-000": (b"short", b"short"), "node-001": play.keys["node-001"]})


def test_clipping_is_counted_and_quantisation_round_trips() -> None:
    values, clipped = quantise(np.array([0.25, -3.0, 2.0, -0.125]), SETTINGS)
    assert clipped == 2
    assert dequantise(values, SETTINGS).tolist() == [0.25, -1.0, 1.0, -0.125]
    with pytest.raises(SecAggError, match="non-finite"):
        quantise(np.array([np.nan]), SETTINGS)


def test_the_neighbour_graph_is_symmetric_regular_and_seeded() -> None:
    ids = [f"n{i:02d}" for i in range(20)]
    graph = neighbour_graph(ids, 6, b"a")
    assert all(len(nb) == 6 for nb in graph.values())
    assert all(v in graph[u] for v in ids for u in graph[v])
    assert graph == neighbour_graph(list(reversed(ids)), 6, b"a") != neighbour_graph(ids, 6, b"b")
    assert all(len(nb) == 19 for nb in neighbour_graph(ids, 0, b"a").values())
    with pytest.raises(ValueError):
        neighbour_graph(ids[:2], 0, b"a")


def test_settings_are_checked() -> None:
    for bad in ({"neighbours": -1}, {"threshold": 0.0}, {"threshold": 1.5}, {"clip": float("nan")}):
        with pytest.raises(ValueError):
            SecAggSettings(**bad)  # type: ignore[arg-type]
    assert SecAggSettings(threshold=0.5).shares_needed(9) == 5
    assert SecAggSettings(threshold=0.1).shares_needed(9) == 2


def test_two_million_entries_from_ten_nodes_unmask() -> None:
    play = Round(10, length=2_000_000, settings=SecAggSettings(neighbours=4, clip=1.0))
    survivors = play.ids[1:]
    assert np.array_equal(play.unmask(survivors).total, play.exact(survivors))
