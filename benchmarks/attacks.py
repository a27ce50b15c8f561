"""`dloco bench attacks`: how far one island's key can move the merger's model, per attack.

Each attack runs twice against the merger's own core (merger/state/core.py, its write-ahead log on
disk, restarts and takeovers through merger/state/recovery.py): once with the attacker, once with
its key silent from the attack on.  Honest islands send the same deltas in both.  The figure is how
far the attack moved the model from where the run without it left it, in multiples of what the
attacker's folds would have moved it had they been honest folds:

    ratio = |theta_attack - theta_without| / (mean movement of one honest fold x the attacker's
folds)

measured after a few more honest rounds (the outer momentum carries an attack on after it ends).
A third run, the control, sends the attacker's deltas at the honest norm (and honest token claims)
along its direction: what any key can do without sending anything a merger could tell from an
honest delta.  `vs_control` is the attack's movement over the control's: 1 is the floor of any
defence that judges norms.  On a fresh merger the first measure reads high even for the control,
since honest folds move little while the outer momentum builds up.

The model is one fragment of 4,096 values of norm ~12.8; an honest delta has norm ~0.26 (the
probe's figures, issue 36), along a shared descent direction plus noise; the attacker pushes along
a direction of its own.  Merger settings: the shipped profile's (share-scaled folds, staleness 8,
Nesterov at 0.15), every delta folded on its own (quorum 1), unless an attack bunches its deltas.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import numpy as np

from dloco import protocol
from dloco.merger.config import MergeConfig, MergerConfig, OuterConfig
from dloco.merger.log.wal import WriteAheadLog
from dloco.merger.state import checkpoint
from dloco.merger.state.core import MergerCore
from dloco.merger.state.recovery import checkpoint_dir, recover, wal_dir
from dloco.merger.state.trained_tokens import TrainedTokens

SIZE, INIT_STD, HONEST_NORM = 4096, 0.2, 0.26
HONEST_TOKENS, HONEST_STEPS = 98_304, 48
CONFIG = MergerConfig(MergeConfig(max_staleness=8, share_window=8), OuterConfig(lr=0.15))
WARMUP_ROUNDS, AFTER_ROUNDS = 6, 10


@dataclasses.dataclass(frozen=True)
class Attack:
    """What the attacker sends: per attack round, its deltas as (multiple of the honest norm,
    claimed tokens); `bunched`: a round's deltas all arrive before the merger folds.  `restart`: the
    merger restarts (from its checkpoint and log) or is replaced by a standby that replays the log,
    just before the attack; `cold`: the attack comes on a fresh merger; `first`: each attack round's
    deltas come before the honest islands' (whose first fold the merger then holds for theirs:
    round.cold_wait_s)."""

    name: str
    rounds: tuple[tuple[tuple[float, int], ...], ...]
    bunched: bool = False
    # "" | "restart" | "takeover"
    restart: str = ""
    cold: bool = False
    first: bool = False


def _ramp(ratio: float, count: int = 32) -> Attack:
    return Attack(
        f"a ramp, each delta {ratio:g}x the last ({count} deltas)",
        tuple(((ratio**k, HONEST_TOKENS),) for k in range(1, count + 1)),
    )


ATTACKS = {
    "ramp-1.2": _ramp(1.2),
    "ramp-1.4": _ramp(1.4),
    "ramp-2": _ramp(2.0),
    "burst": Attack(
        "30 deltas at 15x, back to back", (((15.0, HONEST_TOKENS),) * 30,), bunched=True
    ),
    "single-19x": Attack("a single 19x delta", (((19.0, HONEST_TOKENS),),)),
    "tokens": Attack("tokens claimed as 2^40, 10 deltas in a row", (((1.0, 2**40),) * 10,)),
    "restart-1e6": Attack(
        "1e6x right after a merger restart", (((1e6, HONEST_TOKENS),),), restart="restart"
    ),
    "takeover-1e6": Attack(
        "1e6x right after a standby takes over", (((1e6, HONEST_TOKENS),),), restart="takeover"
    ),
    "fresh-1e6": Attack(
        "1e6x on a fresh merger (no fold movements on record yet)",
        (((1e6, HONEST_TOKENS),),),
        cold=True,
    ),
    "fresh-burst": Attack(
        "10 deltas at 1e6x on a fresh merger", (((1e6, HONEST_TOKENS),) * 10,), cold=True
    ),
    "first-1e6": Attack(
        "1e6x on a fresh merger, before any honest delta",
        (((1e6, HONEST_TOKENS),),),
        cold=True,
        first=True,
    ),
    "first-burst": Attack(
        "10 deltas at 1e6x on a fresh merger, before any honest delta",
        (((1e6, HONEST_TOKENS),) * 10,),
        cold=True,
        first=True,
    ),
}


@dataclasses.dataclass
class Outcome:
    attack: str
    # honest ones, and the attacker
    islands: int
    attacker_folds: int
    # see the module's docstring
    ratio: float
    norm_before: float
    norm_after: float
    # the attacker's deltas refused
    rejected: int
    # folds in which the attacker's part was scaled down
    clipped: int
    # honest deltas refused (should be 0)
    honest_refused: int
    # the trained tokens the merger counts for the attacker's key over the attack (its service's
    # count, merger/state/trained_tokens.py), in honest deltas' worth; it sent `attacker_deltas`
    tokens_counted: float = 0.0
    attacker_deltas: int = 0
    # the attack's movement over the control's (see the module's docstring)
    vs_control: float = 0.0


def _unit(vector: np.ndarray) -> np.ndarray:
    return (vector / np.linalg.norm(vector)).astype(np.float32)


class _Cluster:
    """One merger core on a log in `run_dir`, honest islands and one attacker key."""

    def __init__(self, honest: int, run_dir: Path, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.params = {"w": (rng.standard_normal(SIZE) * INIT_STD).astype(np.float32)}
        self.descent, self.hostile = (
            _unit(rng.standard_normal(SIZE)),
            _unit(rng.standard_normal(SIZE)),
        )
        self.parts = protocol.partition({"w": (SIZE,)}, 1)
        self.model = protocol.model_fingerprint(self.params)
        self.run_dir = run_dir
        self.core = MergerCore(
            CONFIG,
            self.model,
            self.parts,
            self.params,
            log=WriteAheadLog(wal_dir(run_dir), fsync="never"),
        )
        self.honest = [f"honest-{i}" for i in range(honest)]
        self.noise = {
            name: np.random.default_rng((seed, i))
            for i, name in enumerate([*self.honest, "attacker"])
        }
        self.ids = {name: 0 for name in self.noise}
        (
            self.now,
            self.honest_refused,
            self.attacker_folds,
            self.rejected,
            self.clipped,
            self.moves,
        ) = (0.0, 0, 0, 0, 0, [])
        self.trained = TrainedTokens()

    def honest_delta(self, island: str) -> np.ndarray:
        return HONEST_NORM * _unit(
            0.8 * self.descent + 0.6 * _unit(self.noise[island].standard_normal(SIZE))
        )

    def theta(self) -> np.ndarray:
        return np.asarray(self.core.states[0].params["w"], dtype=np.float64)

    def send(self, island: str, values: np.ndarray, tokens: int = HONEST_TOKENS) -> None:
        self.ids[island] += 1
        plans = protocol.split_fragment(
            {"w": values.astype(np.float32)}, protocol.Codec("fp32"), 1 << 20
        )
        chunks = [
            protocol.DeltaChunk(
                sender=island,
                epoch=1,
                seq=self.ids[island] * 4 + i,
                delta_id=self.ids[island],
                fragment=0,
                base_version=self.core.states[0].version,
                chunk_index=i,
                chunk_count=len(plans),
                steps=HONEST_STEPS,
                tokens=tokens,
                model=self.model,
                codec=protocol.Codec("fp32"),
                slices=p.slices,
                payloads=p.payloads,
            )
            for i, p in enumerate(plans)
        ]
        reassembler = protocol.Reassembler()
        assembled = [
            r
            for c in chunks
            if (
                r := reassembler.add(
                    protocol.decode([bytes(f) for f in protocol.encode(c)]), self.now
                )
            )
        ][0]
        self.trained.delta(island, 1, 0, tokens)
        result = self.core.submit(assembled, self.now)
        if result is not None and result.status != "folded":
            if island == "attacker":
                self.rejected += 1
            else:
                self.honest_refused += 1

    def fold(self, live: int | None = None) -> None:
        """Fold what is pending; with `live` (islands heard from), unless the merger's round policy
        holds it (MergerCore.due: a fresh merger's first fold waits for another island's)."""
        if not self.core.pending[0]:
            return
        if live is not None and not self.core.due(self.now, live=live)[0]:
            return
        before = self.theta()
        report, _ = self.core.fold(0)
        self.moves.append(float(np.linalg.norm(self.theta() - before)))
        if "attacker" in report.contributors:
            self.attacker_folds += 1
            self.clipped += "attacker" in report.clipped

    def honest_round(self, attacker_honest: bool = False) -> None:
        self.now += 1.0
        for island in self.honest + (["attacker"] if attacker_honest else []):
            self.send(island, self.honest_delta(island))
            self.fold()

    def restart(self, how: str) -> None:
        """The merger stops and another takes over its log: from the checkpoint and the log's tail
        (a restart), or replaying the whole log (a standby that followed it)."""
        if how == "restart":
            checkpoint.save(checkpoint_dir(self.run_dir), self.core, self.core.log.next_index)
        self.core.log.close()
        if how == "takeover":
            shutil.rmtree(checkpoint_dir(self.run_dir), ignore_errors=True)
        self.core = recover(self.run_dir, WriteAheadLog(wal_dir(self.run_dir), fsync="never"))


def _play(
    attack: Attack, honest: int, run_dir: Path, seed: int, hostile: bool, control: bool = False
) -> _Cluster:
    """The attack (`hostile`), its twin without it, or its `control` (each delta at the honest norm
    and honest tokens)."""
    cluster = _Cluster(honest, run_dir, seed)
    for _ in range(0 if attack.cold else WARMUP_ROUNDS):
        cluster.honest_round(attacker_honest=True)
    if attack.restart:
        cluster.restart(attack.restart)
    cluster.norm_before = float(np.linalg.norm(cluster.theta()))
    cluster.moves, cluster.attacker_folds, cluster.clipped = [], 0, 0
    cluster.attacker_tokens_before = cluster.trained.by_life().get(("attacker", 1), 0)
    for deltas in attack.rounds:
        if not attack.first:
            cluster.honest_round()
        for scale, tokens in deltas:
            if control:
                scale, tokens = 1.0, HONEST_TOKENS
            if hostile:
                cluster.send(
                    "attacker", (scale * HONEST_NORM * cluster.hostile).astype(np.float32), tokens
                )
            if not attack.bunched:
                cluster.fold(live=honest + 1 if attack.first else None)
        if attack.first:
            cluster.honest_round()
        cluster.fold()
    for _ in range(AFTER_ROUNDS):
        cluster.honest_round()
    cluster.core.log.close()
    return cluster


def run_attack(key: str, honest: int = 1, seed: int = 0) -> Outcome:
    """One attack (ATTACKS[key]) against a merger with `honest` honest islands, and its honest
    twin."""
    attack = ATTACKS[key]
    base = Path(tempfile.mkdtemp(prefix="dloco-attack-"))
    try:
        hostile = _play(attack, honest, base / "attack", seed, hostile=True)
        twin = _play(attack, honest, base / "honest", seed, hostile=False)
        control = _play(attack, honest, base / "control", seed, hostile=True, control=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    unit = float(np.mean(twin.moves))
    drift = float(np.linalg.norm(hostile.theta() - twin.theta()))
    return Outcome(
        key,
        honest + 1,
        hostile.attacker_folds,
        drift / (unit * max(1, hostile.attacker_folds)),
        hostile.norm_before,
        float(np.linalg.norm(hostile.theta())),
        hostile.rejected,
        hostile.clipped,
        hostile.honest_refused + twin.honest_refused,
        (hostile.trained.by_life().get(("attacker", 1), 0) - hostile.attacker_tokens_before)
        / HONEST_TOKENS,
        sum(len(deltas) for deltas in attack.rounds),
        drift / float(np.linalg.norm(control.theta() - twin.theta())),
    )


def run(islands: str = "2,4", seed: int = 0) -> dict:
    """Every attack against clusters of each size in `islands` (the attacker counts as one)."""
    sizes = [int(part) for part in str(islands).split(",")]
    if not sizes or min(sizes) < 2:
        raise ValueError(
            "--islands: cluster sizes of at least 2 (one honest island and the attacker), got"
            f" {islands!r}"
        )
    return {
        "outcomes": [
            dataclasses.asdict(run_attack(key, size - 1, seed)) for size in sizes for key in ATTACKS
        ]
    }


def summary(result: dict) -> str:
    lines = [
        (
            "| attack (one island key) | islands | attacker's folds | moved the model, x honest"
            " folds | fragment norm | rejected | clipped | honest deltas refused | trained tokens"
            " counted for its deltas, x honest ones | x the same deltas at honest norm |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in result["outcomes"]:
        lines.append(
            f"| {ATTACKS[o['attack']].name} | {o['islands']} | {o['attacker_folds']} |"
            f" {o['ratio']:.2f} | {o['norm_before']:.1f} -> {o['norm_after']:.1f} | {o['rejected']}"
            f" | {o['clipped']} | {o['honest_refused']} |"
            f" {o['tokens_counted'] / max(1, o['attacker_deltas']):.2f} |"
            f" {o['vs_control']:.2f} |"
        )
    return "\n".join(lines)
