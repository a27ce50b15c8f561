"""Poisoning defence against hand-derived values: delta norms (float, and bounds for coded), the
norm limit, the outlier and overflow verdicts, quarantine; and the merger core refusing a poisoned
delta."""

from __future__ import annotations

import numpy as np
import pytest

from dloco import protocol
from dloco.merger.config import ConfigError, MergeConfig, MergerConfig
from dloco.merger.fold import admission
from dloco.merger.fold.clipping import clip_factors
from dloco.merger.fold.outliers import ColdCap, NormHistory, ParamNorm, Quarantine, fold_caps
from dloco.merger.state.core import MergerCore

LAYOUT = {"w": (2, 2), "b": (2,)}


def candidate(w, b=(0.0, 0.0)) -> admission.Candidate:
    return admission.Candidate(
        "a",
        1,
        1,
        0,
        5,
        10,
        1000,
        "m",
        {"w": np.asarray(w, np.float32).reshape(2, 2), "b": np.asarray(b, np.float32)},
    )


def judge(c, limit=None) -> admission.Verdict:
    return admission.admit(
        c, version=5, layout=LAYOUT, model="m", max_staleness=2, norm_limit=limit
    )


def test_the_norm_is_that_of_all_values_in_float64():
    verdict = judge(candidate([3.0, 0.0, 0.0, 0.0], (0.0, 4.0)))
    assert verdict.admitted and verdict.norm == 5.0
    # the norm limit: 5 is within 5, not within 4.99
    assert judge(candidate([3.0, 0.0, 0.0, 0.0], (0.0, 4.0)), limit=5.0).admitted
    rejected = judge(candidate([3.0, 0.0, 0.0, 0.0], (0.0, 4.0)), limit=4.99)
    assert (rejected.admitted, rejected.reason, rejected.norm) == (False, "outlier_norm", 5.0)


def test_finite_values_whose_squares_overflow_float32_are_non_finite():
    """3e38 is a finite float32, but its square is not: the fold's float32 norms would be
    Infinity."""
    verdict = judge(candidate([3e38, 0.0, 0.0, 0.0]))
    assert (verdict.admitted, verdict.reason) == (
        False,
        "non_finite",
    ) and "overflows" in verdict.detail
    # past sqrt(float32 max) = 1.8447e19
    assert judge(candidate([1.85e19, 0.0, 0.0, 0.0])).reason == "non_finite"
    assert judge(candidate([1.84e19, 0.0, 0.0, 0.0])).admitted


@pytest.mark.parametrize("codec,largest", [("int8", 128), ("int4", 8), ("int2", 2)])
def test_a_coded_deltas_norm_is_bounded_from_its_scales(codec, largest):
    """Each block's values count as its largest level times its scale: 1000 values are three full
    blocks of 256 and one of 232; the bound is at least the decoded values' norm."""
    values = (np.random.default_rng(1).standard_normal(1000) * 0.01).astype(np.float32)
    c = protocol.Codec(codec)
    tensor = protocol.CodedTensor(c, (1000,), c.encode(values).reshape(-1, c.record_nbytes))
    by_hand = sum(
        n * (largest * float(s)) ** 2 for n, s in zip([256, 256, 256, 232], tensor.scales)
    )
    assert admission.delta_norm({"x": tensor}) == pytest.approx(by_hand**0.5, rel=1e-12)
    decoded = tensor.decode().astype(np.float64)
    assert float(np.sqrt(decoded @ decoded)) <= admission.delta_norm({"x": tensor})


def test_the_reference_is_the_other_islands_medians_never_the_senders_own():
    history = NormHistory(window=4, min_own=2)
    # no history: nothing is judged
    assert history.limit("a", 10.0) is None
    for island, norm in [("a", 1.0), ("a", 3.0), ("b", 2.0)]:
        history.record(island, norm)
    # a's median 2.0 (of 1, 3)
    assert history.limit("b", 10.0) == 20.0
    # b holds 1 norm < min_own 2: a, alone, is judged against its own median
    assert history.limit("a", 10.0) == 20.0
    # a newcomer: against a's
    assert history.limit("c", 10.0) == 20.0
    history.record("b", 4.0)
    history.record("c", 6.0)
    history.record("c", 8.0)
    # medians: a 2.0, b 3.0, c 7.0
    # the median of b's 3 and c's 7
    assert history.limit("a", 10.0) == 50.0
    # of a's 2 and b's 3: c's own 7 does not raise it
    assert history.limit("c", 10.0) == 25.0
    assert history.reference("a", "max") == 7.0 and history.reference("c", "max") == 3.0
    # c ramps: its own median climbs, its limit does not
    for norm in (100.0, 140.0, 196.0, 274.0):
        history.record("c", norm)
    assert history.medians["c"] == 168.0 and history.limit("c", 10.0) == 25.0
    for _ in range(4):
        # a's median falls to 0.001
        history.record("a", 0.001)
    # b's reference: a and c
    assert history.limit("b", 10.0) == pytest.approx(10.0 * (0.001 + 168.0) / 2)
    # factor 0: off
    assert history.limit("a", 0.0) is None


def test_a_history_survives_export_and_restore():
    history = NormHistory(window=3, min_own=2)
    for island, norm in [("a", 1.0), ("a", 2.0), ("a", 3.0), ("a", 4.0), ("b", 5.0)]:
        history.record(island, norm)
    again = NormHistory(window=3, min_own=2)
    again.restore(history.export())
    assert (
        again.export() == {"a": [2.0, 3.0, 4.0], "b": [5.0]}
        and again.medians == {"a": 3.0}
        and again.reference("b") == 3.0
    )


def test_quarantine_after_consecutive_hostile_rejections():
    quarantine = Quarantine(strikes=3, seconds=60.0)
    assert not quarantine.judge("x", "outlier_norm", 0.0) and not quarantine.judge(
        "x", "non_finite", 1.0
    )
    # an admitted delta clears the strikes
    assert not quarantine.judge("x", "", 2.0)
    # a stale delta is no sign of hostility
    assert not quarantine.judge("x", "stale", 3.0)
    assert not quarantine.judge("x", "outlier_norm", 4.0) and not quarantine.judge(
        "x", "layout_mismatch", 5.0
    )
    # the third in a row
    assert quarantine.judge("x", "future_base", 6.0)
    assert (
        quarantine.held("x", 6.0) == 60.0
        and quarantine.held("x", 65.0) == 1.0
        and quarantine.held("y", 6.0) == 0.0
    )
    assert quarantine.held("x", 66.0) == 0.0 and "x" not in quarantine.until


def test_the_outlier_factor_is_validated():
    assert MergeConfig(outlier_factor=0).outlier_factor == 0
    with pytest.raises(ConfigError, match="outlier_factor"):
        MergeConfig(outlier_factor=1.5)


def test_the_core_rejects_a_poisoned_delta_and_quarantines_its_sender():
    """Honest deltas of norm ~0.45 build the history; a 1e6x delta is rejected as outlier_norm and
    the global model does not move; five in a row quarantine the island, whose next honest delta is
    refused until the quarantine ends, then admitted again.  Another island is unaffected."""
    from tests.merger_helpers import assemble, delta_chunks, initial_params

    params = initial_params()
    parts = protocol.partition({p: a.shape for p, a in params.items()}, 1)
    core = MergerCore(MergerConfig(), protocol.model_fingerprint(params), parts, params)

    def send(island, delta_id, scale=1.0, now=0.0):
        chunks = delta_chunks(
            parts[0], island, delta_id, 0, core.states[0].version, seed=delta_id, codec="fp32"
        )
        if scale != 1.0:
            chunks = [
                protocol.DeltaChunk(
                    **{
                        **c.__dict__,
                        "payloads": tuple(
                            (np.frombuffer(p, np.float32) * np.float32(scale)).tobytes()
                            for p in c.payloads
                        ),
                    }
                )
                for c in chunks
            ]
        return core.submit(assemble(chunks), now)

    for delta_id in range(1, 9):
        assert send("a" if delta_id % 2 else "b", delta_id) is None
        core.fold(0)
    before = core.digest()
    result = send("a", 100, scale=1e6)
    assert (result.status, result.reason.split(":")[0]) == (
        "rejected",
        "outlier_norm",
    ) and core.digest() == before
    for delta_id in range(101, 105):
        send("a", delta_id, scale=1e6, now=1.0)
    assert core.quarantined == [("a", "outlier_norm", 60.0)] and core.rejected["outlier_norm"] == 5
    assert (
        send("a", 200, now=30.0).reason.startswith("quarantined")
        and core.rejected["quarantined"] == 1
    )
    # b is unaffected
    assert send("b", 201, now=30.0) is None
    # the quarantine is over
    assert send("a", 202, now=61.5) is None


def test_a_cold_cap_is_computed_exactly_only_for_a_part_beyond_its_lower_bound():
    """fold_caps with a ParamNorm: COLD_LIMIT x the bound, and the exact cap asked for (once) only
    by a part that moves more; a part within the bound is scaled and recorded as under the exact
    cap."""
    asked = []
    norm = ParamNorm(exact=lambda: asked.append(1) or 10.0, lower=lambda: 4.0)
    caps = fold_caps(NormHistory(), norm, ["a", "b"], 2.0)
    assert isinstance(caps["a"], ColdCap) and caps["a"].lower == 2.0 and asked == []
    # a moves 1.5 (within 2.0): as under the exact cap of 5.0, nothing asked
    assert clip_factors(["a"], [0.5], [3.0], caps) == ([1.5], [], [1.0])
    assert clip_factors(["a"], [0.5], [3.0], {"a": 5.0}) == ([1.5], [], [1.0]) and asked == []
    # b moves 8.0: the exact cap (5.0) clips it to 5/8, asked once for both islands
    assert clip_factors(["a", "b"], [1.0, 1.0], [3.0, 8.0], caps) == (
        [3.0, 5.0],
        ["b"],
        [1.0, 0.625],
    )
    assert clip_factors(["b"], [1.0], [8.0], caps)[2] == [0.625] and asked == [1]
    # a zero norm caps nothing
    zero = fold_caps(NormHistory(), ParamNorm(lambda: 0.0, lambda: 0.0), ["a"], 2.0)
    assert clip_factors(["a"], [1.0], [8.0], zero) == ([8.0], [], [1.0])
